//! Whether a file can be trusted not to change behind the vetting: who owns it and every
//! directory above it, and who can write to them.
//!
//! Why the whole chain: a file that only its owner may write still moves if any directory
//! above it is writable by someone else (rename the parent away, put another in its place).
//! So, as OpenSSH's `StrictModes` does for `authorized_keys`, every directory from the file up
//! to `/` must be owned by root or by the user running ava and writable by nobody else. A
//! directory writable by others is accepted only with the sticky bit (`/tmp`): there, others
//! cannot rename or delete entries they do not own.

use std::{
    fs,
    path::{Path, PathBuf},
};

/// Why `path` (a regular file) or one of its directories could be changed by another user;
/// `None` when nothing but root and the invoking user can change it. `what` names the file in
/// the message ("the lock file", "the library"). Symbolic links are refused for the file
/// itself; directories are checked both as written and as resolved.
pub fn untrusted_reason(path: &Path, what: &str) -> Option<String> {
    let abs = match std::path::absolute(path) {
        Ok(p) => p,
        Err(e) => return Some(format!("{what} {} cannot be located: {e}", path.display())),
    };
    match fs::symlink_metadata(&abs) {
        Ok(m) if m.file_type().is_symlink() => {
            return Some(format!(
                "{what} {} is a symbolic link (its target can change after vetting); use the file itself",
                abs.display()
            ));
        }
        Ok(m) => {
            if let Some(why) = owner_or_mode(&abs, &m, what, false) {
                return Some(why);
            }
        }
        Err(e) => return Some(format!("{what} {} cannot be checked: {e}", abs.display())),
    }
    for dir in directories_above(&abs) {
        let meta = match fs::symlink_metadata(&dir) {
            Ok(m) => m,
            Err(e) => return Some(format!("directory {} cannot be checked: {e}", dir.display())),
        };
        // A symbolic link among the directories is as safe as the directory it sits in
        // (checked too) and the directories it leads to (checked through the resolved path).
        if meta.file_type().is_symlink() {
            continue;
        }
        if let Some(why) = owner_or_mode(&dir, &meta, &format!("{what}'s directory"), true) {
            return Some(why);
        }
    }
    None
}

/// The directories above `abs` as written and as resolved, each once, nearest first.
fn directories_above(abs: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = abs.ancestors().skip(1).map(Path::to_path_buf).collect();
    if let Some(resolved) = abs.parent().and_then(|p| fs::canonicalize(p).ok()) {
        for d in resolved.ancestors() {
            if !out.iter().any(|o| o == d) {
                out.push(d.to_path_buf());
            }
        }
    }
    out
}

/// The user ava runs as.
fn invoking_user() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn owner_or_mode(path: &Path, meta: &fs::Metadata, what: &str, is_dir: bool) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let (uid, mode) = (meta.uid(), meta.mode());
    let me = invoking_user();
    if uid != 0 && uid != me {
        return Some(format!(
            "{what} {} belongs to uid {uid}, not to root or to you (uid {me}), so its owner could change it after vetting; \
             move it somewhere root or you own",
            path.display()
        ));
    }
    let sticky = mode & 0o1000 != 0;
    let writable = mode & 0o022;
    if writable != 0 && !(is_dir && sticky) {
        let who = match (writable & 0o020 != 0, writable & 0o002 != 0) {
            (true, true) => "group and others",
            (true, false) => "group",
            _ => "others",
        };
        return Some(format!(
            "{what} {} is writable by {who} (mode {:o}), so it could be changed after vetting; fix with chmod go-w {}",
            path.display(),
            mode & 0o7777,
            path.display()
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn setup() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ava-plugins.lock");
        fs::write(&file, "version = 1\n").unwrap();
        fs::set_permissions(&file, fs::Permissions::from_mode(0o644)).unwrap();
        (dir, file)
    }

    #[test]
    fn a_private_file_under_tmp_is_trusted() {
        // /tmp itself is world-writable with the sticky bit: accepted.
        let (_dir, file) = setup();
        assert_eq!(untrusted_reason(&file, "the lock file"), None);
    }

    #[test]
    fn a_writable_file_or_directory_anywhere_up_the_chain_is_named() {
        let (dir, file) = setup();
        fs::set_permissions(&file, fs::Permissions::from_mode(0o666)).unwrap();
        let why = untrusted_reason(&file, "the lock file").unwrap();
        assert!(why.contains("the lock file") && why.contains("writable by group and others (mode 666)"), "{why}");
        fs::set_permissions(&file, fs::Permissions::from_mode(0o644)).unwrap();

        let inner = dir.path().join("a/b");
        fs::create_dir_all(&inner).unwrap();
        let deep = inner.join("libx.so");
        fs::write(&deep, b"x").unwrap();
        fs::set_permissions(&deep, fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(untrusted_reason(&deep, "the library"), None);
        // Two levels up, not the immediate parent.
        fs::set_permissions(dir.path().join("a"), fs::Permissions::from_mode(0o777)).unwrap();
        let why = untrusted_reason(&deep, "the library").unwrap();
        assert!(why.contains(&format!("the library's directory {}", dir.path().join("a").display())), "{why}");
        assert!(why.contains("writable by group and others"), "{why}");
        // With the sticky bit (as /tmp), others cannot move what they do not own.
        fs::set_permissions(dir.path().join("a"), fs::Permissions::from_mode(0o1777)).unwrap();
        assert_eq!(untrusted_reason(&deep, "the library"), None);
    }

    #[test]
    fn a_symbolic_link_is_refused() {
        let (dir, file) = setup();
        let link = dir.path().join("link.lock");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let why = untrusted_reason(&link, "the lock file").unwrap();
        assert!(why.contains("is a symbolic link"), "{why}");
    }

    /// Ownership: run as root, a file given to another uid is refused; as anyone else the
    /// test cannot give files away, so it checks that root's own files are accepted.
    #[test]
    fn a_file_owned_by_another_user_is_refused() {
        let (dir, file) = setup();
        if invoking_user() != 0 {
            eprintln!("skipped: giving a file to another user needs root");
            return;
        }
        std::os::unix::fs::chown(&file, Some(65534), Some(65534)).unwrap();
        let why = untrusted_reason(&file, "the lock file").unwrap();
        assert!(why.contains("belongs to uid 65534, not to root or to you (uid 0)"), "{why}");
        std::os::unix::fs::chown(&file, Some(0), Some(0)).unwrap();
        std::os::unix::fs::chown(dir.path(), Some(65534), None).unwrap();
        let why = untrusted_reason(&file, "the lock file").unwrap();
        assert!(why.contains("the lock file's directory") && why.contains("belongs to uid 65534"), "{why}");
    }
}
