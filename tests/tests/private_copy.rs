//! The loader's private copy under attack: while the host opens a vetted library again and
//! again with the process's umask at 000, another user (uid 65534) renames her library, the
//! canary, over every copy she can find in the shared temporary directory. The canary marks
//! its loading in a file, so a swap that ran would show. Each way the host makes its copy
//! is attacked: a sealed memory file (nothing to find) and a private directory (found, but
//! closed to her).
//!
//! A control proves the attacker works: a directory of the same name left open to her has its
//! file swapped. Cross-user attacks need root to start the attacker as another user; run as
//! anyone else, the attacker is this user, against whom only the memory file holds (a
//! directory is this user's own), so the directory's run is left out, as printed.
//!
//! One test in its own binary: it sets the umask and environment variables for the process.

#![cfg(target_os = "linux")]

use std::{
    fs,
    os::unix::{fs::PermissionsExt as _, process::CommandExt as _},
    path::Path,
    process::{Child, Command},
    time::{Duration, Instant},
};

use ava_plugins::{
    discover::Candidate,
    load::open_copied,
    private_copy::{CopyWay, PrivateCopy},
};
use ava_tests::{CANARY_MARKER_ENV, fixture};

/// Loads per way: the unprotected copy of old lost 5 times out of 6.
const LOADS: usize = 12;

/// The attacker: forever, for every `ava-plugin-*` entry in `$T`, a hard link to her library
/// renamed over each file inside (logged as `swapped`), and every entry seen logged; a count
/// of rounds in `$T/rounds-$ROLE`.
const ATTACK: &str = r#"
cp "$EVIL" "$T/mine-$ROLE.so" || exit 3
i=0
while :; do
  for d in "$T"/ava-plugin-*; do
    [ -e "$d" ] || continue
    echo "seen $d" >> "$LOG"
    for f in "$d"/*; do
      [ -f "$f" ] || continue
      ln -f "$T/mine-$ROLE.so" "$d/.swap" 2>/dev/null && mv -f "$d/.swap" "$f" 2>/dev/null && echo "swapped $f" >> "$LOG"
    done
  done
  i=$((i+1))
  echo "$i" > "$T/rounds-$ROLE"
done
"#;

struct Attacker {
    child: Child,
    log: std::path::PathBuf,
    rounds: std::path::PathBuf,
}

impl Attacker {
    fn start(shared: &Path, evil: &Path, role: &str, cross_user: bool) -> Self {
        let log = shared.join(format!("attack-{role}.log"));
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(ATTACK).env("T", shared).env("EVIL", evil).env("LOG", &log).env("ROLE", role);
        cmd.current_dir(shared);
        if cross_user {
            cmd.uid(65534).gid(65534);
        }
        let child = cmd.spawn().expect("the attacker starts");
        let attacker = Self { child, log, rounds: shared.join(format!("rounds-{role}")) };
        attacker.wait_rounds(2);
        attacker
    }

    /// Waits until the attacker has gone `n` rounds past the present.
    fn wait_rounds(&self, n: u64) {
        let now = self.rounds_done();
        let until = Instant::now() + Duration::from_secs(30);
        while self.rounds_done() < now + n {
            assert!(Instant::now() < until, "the attacker makes no progress (see {})", self.log.display());
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn rounds_done(&self) -> u64 {
        fs::read_to_string(&self.rounds).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
    }

    /// Stops it; its log's lines.
    fn stop(self) -> Vec<String> {
        let log = self.log.clone();
        drop(self);
        fs::read_to_string(&log).unwrap_or_default().lines().map(str::to_string).collect()
    }
}

impl Drop for Attacker {
    /// A test that fails midway must not leave her running (she holds its output open).
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn count(lines: &[String], what: &str) -> usize {
    lines.iter().filter(|l| l.starts_with(what)).count()
}

#[test]
fn another_user_cannot_swap_the_copy_the_loader_opens() {
    let vetted = fixture("sign-sgd");
    let canary = fixture("canary");
    let private = tempfile::tempdir().unwrap();
    let marker = private.path().join("canary-marker");
    // SAFETY: the only test of this binary, before it starts any thread.
    unsafe {
        libc::umask(0);
    }
    // A shared temporary directory like /tmp (anyone writes, sticky), under the umask set.
    let shared = tempfile::tempdir().unwrap();
    fs::set_permissions(shared.path(), fs::Permissions::from_mode(0o1777)).unwrap();
    // SAFETY: as above: no other thread reads the environment.
    unsafe {
        std::env::set_var("TMPDIR", shared.path());
        std::env::set_var(CANARY_MARKER_ENV, &marker);
    }
    let evil = shared.path().join("evil.so");
    fs::copy(&canary, &evil).unwrap();
    fs::set_permissions(&evil, fs::Permissions::from_mode(0o644)).unwrap();
    // SAFETY: geteuid has no preconditions.
    let cross_user = unsafe { libc::geteuid() } == 0;

    // The control: a directory open to her has its file swapped.
    let attacker = Attacker::start(shared.path(), &evil, "control", cross_user);
    let open = shared.path().join("ava-plugin-control");
    fs::create_dir(&open).unwrap();
    fs::set_permissions(&open, fs::Permissions::from_mode(0o777)).unwrap();
    fs::write(open.join("libvictim.so"), b"victim").unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    while fs::read(open.join("libvictim.so")).unwrap() == b"victim" {
        assert!(Instant::now() < until, "the attacker never swapped a file open to her");
        std::thread::sleep(Duration::from_millis(5));
    }
    let control = attacker.stop();
    assert!(count(&control, "swapped") >= 1, "{control:?}");
    fs::remove_dir_all(&open).unwrap();

    let ways: &[CopyWay] = if cross_user { &[CopyWay::Best, CopyWay::Directory] } else { &[CopyWay::Best] };
    if !cross_user {
        eprintln!("not root: the attacker is this user, so only the memory file is attacked");
    }
    for &way in ways {
        let role = format!("{way:?}").to_lowercase();
        let attacker = Attacker::start(shared.path(), &evil, &role, cross_user);
        // A copy held while she goes over the directory three times is still the bytes.
        let candidate = Candidate::read(&vetted).unwrap();
        let copy = PrivateCopy::new(&candidate, way).unwrap();
        assert_eq!(copy.is_sealed(), way == CopyWay::Best, "a Linux host copies into a sealed memory file");
        attacker.wait_rounds(3);
        copy.check(&candidate).unwrap();
        drop(copy);
        for i in 0..LOADS {
            let candidate = Candidate::read(&vetted).unwrap();
            let lib = open_copied(&candidate, way).unwrap_or_else(|e| panic!("load {i} {way:?}: {e}"));
            assert_eq!(lib.manifest.name.as_str(), "sign-sgd", "load {i} {way:?}");
            assert!(!marker.exists(), "load {i} {way:?}: the attacker's library ran in this process");
            // Give her time between loads, as a slow start-up would.
            attacker.wait_rounds(1);
        }
        let log = attacker.stop();
        assert_eq!(count(&log, "swapped"), 0, "{way:?}: {log:?}");
        match way {
            // Nothing in the file system to find.
            CopyWay::Best => assert_eq!(count(&log, "seen"), 0, "{log:?}"),
            // She saw the directories, and could do nothing with them.
            _ => assert!(count(&log, "seen") >= 1, "the attacker never saw a private directory: {log:?}"),
        }
        let left: Vec<_> = fs::read_dir(shared.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("ava-plugin-"))
            .collect();
        assert!(left.is_empty(), "{way:?}: copies left behind: {left:?}");
    }
    assert!(!marker.exists());
}
