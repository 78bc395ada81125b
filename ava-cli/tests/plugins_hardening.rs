//! `ava plugins` against files other users and other policies see: the lock `plugins vet`
//! writes is readable by every user, a lock that cannot be read is a usage error (exit code
//! 2) saying how to fix it, and `plugins info PATH` opens a library outside the search paths
//! only when the policy in force would open it there.
//!
//! CI runs as root; another user is `nobody` (uid 65534), acted as with `setpriv` for one
//! command. Every file lives in a temporary directory; nothing outlives the test. Each run
//! gets a policy file (`$AVA_POLICY_FILE`) whose `search_paths` is the sandbox's `plugins/`,
//! so the libraries next to the `ava` binary are not searched.

#![cfg(target_os = "linux")]

use std::{
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::Command,
};

/// `nobody`.
const OTHER_USER: &str = "65534";

struct Sandbox {
    _dir: tempfile::TempDir,
    root: PathBuf,
}

#[derive(Debug)]
struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

fn set_mode(path: &Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
}

fn mode(path: &Path) -> u32 {
    fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

impl Sandbox {
    /// A sandbox every user can enter (mode 0755), holding the canary in `plugins/` and a
    /// policy file with `policy_line` that searches only there.
    fn new(policy_line: &str) -> Sandbox {
        let dir = tempfile::tempdir().unwrap();
        let root = fs::canonicalize(dir.path()).unwrap();
        set_mode(&root, 0o755);
        let s = Sandbox { _dir: dir, root };
        s.write("policy.yaml", &format!("{policy_line}search_paths: [{}]\n", s.path("plugins").display()), 0o644);
        fs::create_dir(s.path("plugins")).unwrap();
        set_mode(&s.path("plugins"), 0o755);
        s
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    fn write(&self, rel: &str, text: &str, mode: u32) -> PathBuf {
        let path = self.path(rel);
        fs::write(&path, text).unwrap();
        set_mode(&path, mode);
        path
    }

    /// A copy of the canary fixture in `rel` (a directory made 0755), mode 0755.
    fn canary(&self, rel: &str) -> PathBuf {
        let dir = self.path(rel);
        fs::create_dir_all(&dir).unwrap();
        set_mode(&dir, 0o755);
        let lib = ava_tests::fixture("canary");
        let copy = dir.join(lib.file_name().unwrap());
        fs::copy(&lib, &copy).unwrap();
        set_mode(&copy, 0o755);
        copy
    }

    /// Runs `ava`, as `user` when given (through `setpriv`), with no `AVA*` variable but
    /// the policy file and `env`.
    fn ava(&self, user: Option<&str>, args: &[&str], env: &[(&str, &Path)]) -> Out {
        let exe = env!("CARGO_BIN_EXE_ava");
        let mut cmd = match user {
            Some(uid) => {
                let mut c = Command::new("setpriv");
                c.args([&format!("--reuid={uid}"), &format!("--regid={uid}"), "--clear-groups", exe]);
                c
            }
            None => Command::new(exe),
        };
        cmd.args(args).current_dir(&self.root).env("NO_COLOR", "1");
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("AVA") {
                cmd.env_remove(&key);
            }
        }
        cmd.env("AVA_POLICY_FILE", self.path("policy.yaml"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
        Out {
            code: out.status.code().unwrap_or_else(|| panic!("ava was killed by a signal: {out:?}")),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

/// `sudo ava plugins vet --lock /etc/ava/ava-plugins.lock` wrote the lock 0600 (a temporary
/// file's mode), after which every other user's command failed on it.
#[test]
fn plugins_vet_writes_a_lock_every_user_can_read() {
    let s = Sandbox::new("");
    let lib = s.canary("plugins");
    fs::create_dir(s.path("etc")).unwrap();
    set_mode(&s.path("etc"), 0o755);
    let lock = s.path("etc/ava-plugins.lock");
    let out = s.ava(None, &["plugins", "vet", lib.to_str().unwrap(), "--lock", lock.to_str().unwrap()], &[]);
    assert_eq!(out.code, 0, "{out:#?}");
    assert_eq!(mode(&lock), 0o644);
    // Re-vetting replaces the file and keeps the mode.
    let out = s.ava(None, &["plugins", "vet", lib.to_str().unwrap(), "--lock", lock.to_str().unwrap()], &[]);
    assert_eq!((out.code, mode(&lock)), (0, 0o644), "{out:#?}");
    if !is_root() {
        return; // Acting as another user needs root.
    }
    let lock_set = format!("plugins.lock_file={}", lock.display());
    let out = s.ava(Some(OTHER_USER), &["plugins", "list", "--set", "plugins.policy=vetted", "--set", &lock_set], &[]);
    assert_eq!(out.code, 0, "{out:#?}");
    assert!(out.stdout.lines().any(|l| l.starts_with("canary ") && l.contains(" vetted ")), "{out:#?}");
}

/// A lock file that exists but cannot be read was an I/O failure (exit code 1); it is a
/// problem with the setup, exit code 2, with the path and how to fix it.
#[test]
fn a_lock_that_cannot_be_read_is_a_usage_error_saying_how_to_fix_it() {
    let s = Sandbox::new("");
    let lib = s.canary("plugins");
    let lib = lib.to_str().unwrap();

    // A directory where the lock should be (any user, root included).
    fs::create_dir(s.path("dir.lock")).unwrap();
    let dir_lock = s.path("dir.lock");
    let out = s.ava(None, &["plugins", "vet", lib, "--lock", dir_lock.to_str().unwrap()], &[]);
    assert_eq!(out.code, 2, "{out:#?}");
    assert!(out.stderr.contains(&format!("{}: is a directory, not a regular file", dir_lock.display())), "{out:#?}");

    if !is_root() {
        return; // Acting as another user needs root.
    }
    // Root's lock, 0600: nobody cannot read it.
    let lock = s.write("root.lock", "version = 1\n", 0o600);
    let want = format!(
        "{0}: the lock file cannot be read (Permission denied (os error 13)); make it readable by the users who run \
         ava (`chmod 644 {0}`, and let them into its directory; a lock file holds hashes, not secrets), or name \
         another with plugins.lock_file",
        lock.display()
    );
    let lock_set = format!("plugins.lock_file={}", lock.display());
    for args in [
        vec!["plugins", "list", "--set", &lock_set],
        vec!["plugins", "info", "canary", "--set", &lock_set],
        vec!["plugins", "vet", lib, "--lock", lock.to_str().unwrap()],
    ] {
        let out = s.ava(Some(OTHER_USER), &args, &[]);
        assert_eq!(out.code, 2, "{args:?}: {out:#?}");
        assert!(out.stderr.contains(&want), "{args:?}: {out:#?}");
    }
    assert_eq!(fs::read_to_string(&lock).unwrap(), "version = 1\n", "the unreadable lock was not replaced");
}

/// `plugins info PATH` opened (dlopen, running its initializers) any library outside the
/// search paths, even under a vetted floor that would refuse it there. The canary's
/// initializer appends to `$AVA_CANARY_MARKER` when the library is opened.
#[test]
fn plugins_info_path_opens_a_library_only_when_the_policy_would() {
    let s = Sandbox::new("policy: vetted\n");
    let lib = s.canary("elsewhere");
    let marker = s.path("marker");
    let env = [("AVA_CANARY_MARKER", marker.as_path())];
    let out = s.ava(None, &["plugins", "info", lib.to_str().unwrap()], &env);
    assert_eq!(out.code, 0, "{out:#?}");
    assert!(!marker.exists(), "an unpinned library was opened under a vetted floor: {out:#?}");
    assert!(out.stdout.starts_with(&format!("{} (not opened: its manifest is unknown)\n", lib.display())), "{out:#?}");
    assert!(out.stdout.contains("  status:    refused\n"), "{out:#?}");
    assert!(out.stdout.contains("  note:      not pinned in the lock file (sha256 "), "{out:#?}");
    assert!(out.stdout.contains(&format!("pin it with `ava plugins vet {}`", lib.display())), "{out:#?}");
    assert!(out.stderr.contains("is not in a search path; it is vetted as if it were, under policy 'vetted'"));
    let json = s.ava(None, &["--format", "json", "plugins", "info", lib.to_str().unwrap()], &env);
    assert_eq!(json.code, 0, "{json:#?}");
    let v: serde_json::Value = serde_json::from_str(&json.stdout).unwrap();
    assert_eq!((v["status"].as_str(), v["name"].as_str()), (Some("refused"), None), "{v}");
    assert!(!marker.exists());

    // Under policy open the same command opens it and shows its manifest.
    s.write("policy.yaml", &format!("policy: open\nsearch_paths: [{}]\n", s.path("plugins").display()), 0o644);
    let out = s.ava(None, &["plugins", "info", lib.to_str().unwrap()], &env);
    assert_eq!(out.code, 0, "{out:#?}");
    assert!(out.stdout.starts_with("canary (optimizer) 0.1.0\n"), "{out:#?}");
    assert!(out.stdout.contains("  note:      not in any search path, so ava would not find it\n"), "{out:#?}");
    assert!(fs::read_to_string(&marker).unwrap().ends_with(" loaded\n"), "the control did not open the canary");
}
