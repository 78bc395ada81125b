//! Links, FIFOs and devices planted in a directory are refused, never followed or waited on.

use std::os::unix::fs::{PermissionsExt, symlink};
use std::sync::mpsc;
use std::time::Duration;

use super::*;

/// `f` on another thread; the test fails (instead of hanging) if it does not answer in time.
fn within<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(20)).expect("the operation waited instead of answering")
}

fn mkfifo(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

#[test]
fn files_are_created_replaced_read_and_removed_through_the_handle() {
    let root = tempfile::tempdir().unwrap();
    let dir = Dir::create_all(&root.path().join("a/b")).unwrap();
    let sub = dir.create_dir("model", 0o700).unwrap();
    assert_eq!(sub.path(), root.path().join("a/b/model"));
    sub.replace("config.json", 0o600, |f| f.write_all(b"{}")).unwrap();
    sub.replace("config.json", 0o600, |f| f.write_all(b"{\"a\": 1}")).unwrap();
    assert_eq!(sub.read("config.json", 100).unwrap(), b"{\"a\": 1}");
    let meta = std::fs::metadata(sub.path().join("config.json")).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(std::fs::read_dir(sub.path()).unwrap().count(), 1, "no temp file is left");
    assert!(matches!(sub.read("config.json", 3), Err(DirError::Read(ReadError::TooLarge { .. }))));
    // The same directory again: created once, opened after.
    dir.create_dir("model", 0o700).unwrap();
    sub.remove_file("config.json").unwrap();
    sub.remove_file("config.json").unwrap();
    dir.remove_dir("model").unwrap();
    assert!(dir.lstat("model").unwrap().is_none());
    assert_eq!(dir.owner().unwrap(), euid());
}

#[test]
fn a_failed_fill_leaves_the_old_file_and_no_temp_file() {
    let root = tempfile::tempdir().unwrap();
    let dir = Dir::open(root.path()).unwrap();
    dir.replace("f", 0o644, |f| f.write_all(b"old")).unwrap();
    let e = dir.replace("f", 0o644, |_| Err(io::Error::other("disk on fire"))).unwrap_err();
    assert!(e.to_string().contains("cannot write: disk on fire"), "{e}");
    assert_eq!(std::fs::read(root.path().join("f")).unwrap(), b"old");
    assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1);
}

/// A `model` link planted where a run writes its model: refused naming it, and the files
/// where it points are untouched.
#[test]
fn a_link_planted_as_a_directory_is_refused_and_nothing_is_written_through_it() {
    if euid() != 0 {
        eprintln!("skipping: it needs root, to make a link another user's");
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    std::fs::write(elsewhere.path().join("config.json"), b"theirs").unwrap();
    symlink(elsewhere.path(), root.path().join("model")).unwrap();
    std::os::unix::fs::lchown(root.path().join("model"), Some(65534), Some(65534)).unwrap();
    let dir = Dir::open(root.path()).unwrap();
    let e = dir.create_dir("model", 0o755).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, DirError::Planted { what: "a symbolic link", .. }), "{text}");
    assert!(text.starts_with(&format!("{}: is a symbolic link (owned by uid", root.path().join("model").display())));
    assert!(text.contains("where Ava expected a directory") && text.contains("remove it"), "{text}");
    assert_eq!(std::fs::read(elsewhere.path().join("config.json")).unwrap(), b"theirs");
    let e = Dir::open(&root.path().join("model")).unwrap_err();
    assert!(matches!(e, DirError::Planted { what: "a symbolic link", .. }), "{e}");
}

/// A link to a directory that this user owns (`checkpoints` on a bigger disk) is the user's
/// own choice: followed, as a directory and as a subdirectory.
#[test]
fn a_link_of_ones_own_to_a_directory_is_followed() {
    let root = tempfile::tempdir().unwrap();
    let bigger = tempfile::tempdir().unwrap();
    symlink(bigger.path(), root.path().join("checkpoints")).unwrap();
    let dir = Dir::open(root.path()).unwrap();
    let sub = dir.create_dir("checkpoints", 0o755).unwrap();
    sub.replace("a", 0o644, |f| f.write_all(b"x")).unwrap();
    assert_eq!(std::fs::read(bigger.path().join("a")).unwrap(), b"x");
    Dir::open(&root.path().join("checkpoints")).unwrap().open_file("a", Access::Read, 0).unwrap();
    // A link of one's own to something that is not a directory still fails, naming the path.
    symlink(bigger.path().join("a"), root.path().join("file-link")).unwrap();
    let e = Dir::open(&root.path().join("file-link")).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "{}: cannot open the directory its link names",
            root.path().join("file-link").display()
        )),
        "{e}"
    );
}

/// A link planted in place of a file that is replaced is itself replaced; its target keeps
/// its content. Opened, it is refused.
#[test]
fn a_link_planted_as_a_file_is_replaced_or_refused_never_followed() {
    let root = tempfile::tempdir().unwrap();
    let victim = root.path().join("victim");
    std::fs::write(&victim, b"keep").unwrap();
    let dir = Dir::create_all(&root.path().join("run")).unwrap();
    symlink(&victim, dir.path().join("latest")).unwrap();
    let e = dir.open_file("latest", Access::ReadWriteCreate, 0o644).unwrap_err();
    assert!(e.to_string().contains("is a symbolic link"), "{e}");
    let e = dir.create_new("latest", 0o644).unwrap_err();
    assert!(matches!(&e, DirError::Io { source, .. } if source.kind() == io::ErrorKind::AlreadyExists), "{e}");
    dir.replace("latest", 0o644, |f| f.write_all(b"step-1\n")).unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    assert!(std::fs::symlink_metadata(dir.path().join("latest")).unwrap().is_file());
}

#[test]
fn a_fifo_or_a_device_is_refused_at_once() {
    let root = tempfile::tempdir().unwrap();
    mkfifo(&root.path().join("lock"));
    let path = root.path().to_path_buf();
    let e = within(move || Dir::open(&path).unwrap().open_file("lock", Access::ReadWriteCreate, 0o600)).unwrap_err();
    assert!(e.to_string().contains("lock: is a FIFO (named pipe)"), "{e}");
    let path = root.path().to_path_buf();
    let e = within(move || Dir::open(&path).unwrap().read("lock", 100)).unwrap_err();
    assert!(e.to_string().contains("is a FIFO (named pipe)"), "{e}");
    let e = Dir::open(Path::new("/dev")).unwrap().open_file("null", Access::Read, 0).unwrap_err();
    assert!(e.to_string().contains("/dev/null: is a character device"), "{e}");
    let e = Dir::open(&root.path().join("lock")).unwrap_err();
    assert!(e.to_string().contains("is a FIFO (named pipe) (owned by uid"), "{e}");
}

#[test]
fn names_must_be_plain() {
    let root = tempfile::tempdir().unwrap();
    let dir = Dir::open(root.path()).unwrap();
    for name in ["", ".", "..", "a/b", "../x"] {
        assert!(matches!(dir.create_dir(name, 0o700), Err(DirError::BadName { .. })), "{name:?}");
    }
}

/// The owner of what was planted is named: as root, a link made another user's.
#[test]
fn the_owner_of_a_planted_entry_is_named() {
    if euid() != 0 {
        eprintln!("skipping the_owner_of_a_planted_entry_is_named: it needs root, to make a link another user's");
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let link = root.path().join("checkpoints");
    symlink("/etc", &link).unwrap();
    std::os::unix::fs::lchown(&link, Some(65534), Some(65534)).unwrap();
    let e = Dir::open(root.path()).unwrap().create_dir("checkpoints", 0o755).unwrap_err();
    assert!(e.to_string().contains("is a symbolic link (owned by uid 65534)"), "{e}");
}

/// Fuzzing: any names, any sequence of operations, in a directory with a link to a folder
/// outside and a FIFO planted in it: Ok or Err, never a panic or a wait, and nothing outside
/// the directory is ever made, changed or removed.
mod fuzz {
    use proptest::prelude::*;
    use proptest::test_runner::Config as PropConfig;

    use super::*;

    fn name() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("link".to_string()),
            Just("fifo".to_string()),
            Just("..".to_string()),
            Just(".".to_string()),
            Just("".to_string()),
            Just("link/x".to_string()),
            Just("../outside/sentinel".to_string()),
            Just("a\0b".to_string()),
            "[a-z./\\\\]{1,6}",
            any::<String>(),
        ]
    }

    /// The contents of `dir` (names and bytes, recursively, links not followed).
    fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            if meta.is_dir() {
                out.extend(snapshot(&path));
            } else if meta.is_file() {
                out.push((path.clone(), std::fs::read(&path).unwrap()));
            } else {
                out.push((path, Vec::new()));
            }
        }
        out.sort();
        out
    }

    fn run(ops: Vec<(u8, String)>) {
        let root = tempfile::tempdir().unwrap();
        let (inside, outside) = (root.path().join("inside"), root.path().join("outside"));
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("sentinel"), b"keep").unwrap();
        std::fs::create_dir(&inside).unwrap();
        // Another user's link (one of this user's own is followed, by design, so without
        // root, to make it another user's, there is none).
        if euid() == 0 {
            symlink(&outside, inside.join("link")).unwrap();
            std::os::unix::fs::lchown(inside.join("link"), Some(65534), Some(65534)).unwrap();
        }
        mkfifo(&inside.join("fifo"));
        let before = snapshot(&outside);
        let dir = Dir::open(&inside).unwrap();
        for (op, name) in ops {
            let _ = match op % 6 {
                0 => dir.create_dir(&name, 0o700).map(drop),
                1 => dir.replace(&name, 0o600, |f| f.write_all(b"new")),
                2 => dir.open_file(&name, Access::ReadWriteCreate, 0o600).map(drop),
                3 => dir.read(&name, 16).map(drop),
                4 => dir.remove_file(&name),
                _ => dir.open_dir(&name).and_then(|d| d.replace("f", 0o600, |f| f.write_all(b"x"))),
            };
        }
        assert_eq!(snapshot(&outside), before, "something outside the directory changed");
        let mut top: Vec<_> = std::fs::read_dir(root.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        top.sort();
        assert_eq!(top, ["inside", "outside"], "something was made beside the directory");
    }

    proptest! {
        #![proptest_config(PropConfig {
            // `$PROPTEST_CASES` to fuzz longer, as the other crates' property tests take it
            // (ava_kernels::testing::proptest_cases; ava-fs depends on no other Ava crate).
            cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64),
            failure_persistence: None,
            ..PropConfig::default()
        })]

        #[test]
        fn no_operation_reaches_outside_the_directory(ops in prop::collection::vec((any::<u8>(), name()), 1..12)) {
            within(move || run(ops));
        }
    }
}
