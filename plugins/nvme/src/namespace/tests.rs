//! The run directory in a path other users can write to: their directories are never
//! touched, a FIFO or link planted where a lock goes is refused at once, modes are private.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::sync::mpsc;
use std::time::Duration;

use super::*;

/// The uid of `nobody`, the other user of these tests.
const NOBODY: u32 = 65534;

/// Whether this process can act as another user (make files theirs); if not, says why the
/// test is skipped.
fn root_or_skip(test: &str) -> bool {
    let root = euid() == 0;
    if !root {
        eprintln!("skipping {test}: it needs root, to make files owned by another user (uid {NOBODY})");
    }
    root
}

/// `RunDir::create(path)` on another thread, failing the test if it does not answer within
/// `secs` (a regression that waits on a FIFO fails instead of hanging the suite).
fn create_within(path: &Path, secs: u64) -> io::Result<RunDir> {
    let (tx, rx) = mpsc::channel();
    let path = path.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(RunDir::create(&path));
    });
    rx.recv_timeout(Duration::from_secs(secs)).expect("RunDir::create waited instead of answering")
}

fn mkfifo(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "{}", io::Error::last_os_error());
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path).unwrap().permissions().mode() & 0o7777
}

#[test]
fn runs_get_their_own_locked_directories_and_dead_ones_are_cleared() {
    let root = tempfile::tempdir().unwrap();
    let a = RunDir::create(root.path()).unwrap();
    let b = RunDir::create(root.path()).unwrap();
    assert_ne!(a.dir, b.dir);
    assert_eq!(a.dir.parent().unwrap(), root.path().join(format!("ava-{}", euid())));
    assert_eq!((a.removed_leftovers, b.removed_leftovers), (0, 0), "a live run's directory is kept");
    // A dead run: its directory is there, its lock is not held.
    let dead = a.dir.parent().unwrap().join("ava-run-0123");
    std::fs::create_dir(&dead).unwrap();
    File::create(dead.join("lock")).unwrap();
    std::fs::write(dead.join("x"), b"old").unwrap();
    let c = RunDir::create(root.path()).unwrap();
    assert_eq!(c.removed_leftovers, 1);
    assert!(!dead.exists() && a.dir.exists() && b.dir.exists());
    let dir = a.dir.clone();
    drop(a);
    assert!(!dir.exists(), "a run's records go with it");
    let users = dir.parent().unwrap().to_path_buf();
    drop((b, c));
    assert!(!users.exists(), "the user's directory goes with their last run");
    assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
}

#[test]
fn the_user_and_run_directories_and_the_lock_are_private() {
    let root = tempfile::tempdir().unwrap();
    let run = RunDir::create(root.path()).unwrap();
    assert_eq!(mode(run.dir.parent().unwrap()), 0o700);
    assert_eq!(mode(&run.dir), 0o700);
    assert_eq!(mode(&run.dir.join("lock")), 0o600);
}

#[test]
fn a_fifo_planted_as_a_lock_is_refused_at_once_naming_it() {
    let root = tempfile::tempdir().unwrap();
    let first = RunDir::create(root.path()).unwrap();
    let users = first.dir.parent().unwrap().to_path_buf();
    let planted = users.join("ava-run-feed");
    std::fs::create_dir(&planted).unwrap();
    mkfifo(&planted.join("lock"));
    let e = create_within(root.path(), 20).unwrap_err().to_string();
    assert!(e.contains(&format!("{} is a FIFO (named pipe)", planted.join("lock").display())), "{e}");
    assert!(e.contains("remove it"), "{e}");
}

#[test]
fn a_link_planted_as_a_lock_is_refused_and_its_target_untouched() {
    let root = tempfile::tempdir().unwrap();
    let first = RunDir::create(root.path()).unwrap();
    let users = first.dir.parent().unwrap().to_path_buf();
    let victim = root.path().join("victim");
    std::fs::write(&victim, b"keep").unwrap();
    let planted = users.join("ava-run-beef");
    std::fs::create_dir(&planted).unwrap();
    std::os::unix::fs::symlink(&victim, planted.join("lock")).unwrap();
    let e = create_within(root.path(), 20).unwrap_err().to_string();
    assert!(e.contains(&format!("{} is a symbolic link", planted.join("lock").display())), "{e}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
}

#[test]
fn a_per_user_directory_that_is_a_link_or_open_to_others_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let mine = root.path().join(format!("ava-{}", euid()));
    std::os::unix::fs::symlink(elsewhere.path(), &mine).unwrap();
    let e = create_within(root.path(), 20).unwrap_err().to_string();
    assert!(e.contains(&format!("{} is a symbolic link", mine.display())), "{e}");
    assert_eq!(std::fs::read_dir(elsewhere.path()).unwrap().count(), 0, "nothing was made through the link");

    std::fs::remove_file(&mine).unwrap();
    std::fs::create_dir(&mine).unwrap();
    std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o755)).unwrap();
    let e = create_within(root.path(), 20).unwrap_err().to_string();
    assert!(e.contains("has mode 755") && e.contains("chmod 700"), "{e}");
}

/// Another user's directories in a shared path: their dead run (lock not held, directory
/// not ours to remove) is neither touched nor an error, and a FIFO they planted is never
/// opened; this run goes into its own directory.
#[test]
fn another_users_directories_in_a_shared_path_are_left_alone() {
    if !root_or_skip("another_users_directories_in_a_shared_path_are_left_alone") {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let theirs = root.path().join(format!("ava-{NOBODY}"));
    let dead = theirs.join("ava-run-0123");
    std::fs::create_dir_all(&dead).unwrap();
    File::create(dead.join("lock")).unwrap();
    let fifo_run = theirs.join("ava-run-4567");
    std::fs::create_dir(&fifo_run).unwrap();
    mkfifo(&fifo_run.join("lock"));
    // An old layout's run directory straight in the path, also theirs.
    let legacy = root.path().join("ava-run-89ab");
    std::fs::create_dir(&legacy).unwrap();
    File::create(legacy.join("lock")).unwrap();
    for p in [&theirs, &dead, &dead.join("lock"), &fifo_run, &fifo_run.join("lock"), &legacy, &legacy.join("lock")] {
        std::os::unix::fs::lchown(p, Some(NOBODY), Some(NOBODY)).unwrap();
    }
    std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();

    let run = create_within(root.path(), 20).unwrap();
    assert_eq!(run.dir.parent().unwrap(), root.path().join(format!("ava-{}", euid())));
    assert_eq!(run.removed_leftovers, 0);
    assert!(dead.join("lock").exists() && fifo_run.join("lock").exists() && legacy.join("lock").exists());
    assert_eq!(std::fs::metadata(&theirs).unwrap().uid(), NOBODY);
}

/// A per-user directory made in advance by another user under this user's name (a squat:
/// it would let them read or swap this user's records) is passed over, untouched, for the
/// next name, and said; a link of theirs there too. When every name is taken, the error says
/// to use a path of one's own.
#[test]
fn a_per_user_directory_made_by_another_user_is_passed_over() {
    if !root_or_skip("a_per_user_directory_made_by_another_user_is_passed_over") {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let uid = euid();
    let mine = root.path().join(format!("ava-{uid}"));
    std::fs::create_dir(&mine).unwrap();
    std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::os::unix::fs::lchown(&mine, Some(NOBODY), Some(NOBODY)).unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let next = root.path().join(format!("ava-{uid}-1"));
    std::os::unix::fs::symlink(elsewhere.path(), &next).unwrap();
    std::os::unix::fs::lchown(&next, Some(NOBODY), Some(NOBODY)).unwrap();

    let run = create_within(root.path(), 20).unwrap();
    assert_eq!(run.dir.parent().unwrap(), root.path().join(format!("ava-{uid}-2")));
    assert_eq!(run.squatted, vec![(mine.clone(), NOBODY), (next.clone(), NOBODY)]);
    assert_eq!(std::fs::metadata(&mine).unwrap().uid(), NOBODY, "theirs is left alone");
    assert_eq!(std::fs::read_dir(elsewhere.path()).unwrap().count(), 0, "nothing was made through their link");
    drop(run);

    for n in 2..16 {
        let d = root.path().join(format!("ava-{uid}-{n}"));
        std::fs::create_dir_all(&d).unwrap();
        std::os::unix::fs::lchown(&d, Some(NOBODY), Some(NOBODY)).unwrap();
    }
    let e = create_within(root.path(), 20).unwrap_err().to_string();
    assert!(e.contains(&format!("ava-{uid} and the 15 names after it are other users' (uid {NOBODY})")), "{e}");
    assert!(e.contains("set plugins.offload.path to a directory of your own"), "{e}");
}
