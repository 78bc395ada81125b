//! Room for a checkpoint: a run checks when it starts that the disk of its checkpoints can
//! take one more, so that a full disk is found before the steps a save would keep, not at it.

use std::io;
use std::path::Path;

use super::SaveError;

/// Bytes an unprivileged process may still write on the filesystem holding `path`, asked of
/// its nearest existing ancestor (a run's checkpoint directory may not exist yet).
pub fn free_space(path: &Path) -> io::Result<u64> {
    let existing = path.ancestors().find(|p| p.exists()).unwrap_or(Path::new("."));
    available(existing)
}

#[cfg(unix)]
fn available(dir: &Path) -> io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let mut fs = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: a NUL-terminated path, and room for the answer.
    if unsafe { libc::statvfs(path.as_ptr(), fs.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: filled by the successful call.
    let fs = unsafe { fs.assume_init() };
    #[allow(clippy::unnecessary_cast)] // u32 or u64 by platform
    Ok((fs.f_bavail as u64).saturating_mul(fs.f_frsize as u64))
}

#[cfg(not(unix))]
fn available(_dir: &Path) -> io::Result<u64> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "free space is only known on unix"))
}

/// Refuses a run whose next checkpoint (`weights` and `state` bytes plus their headers) does
/// not fit in the `free` bytes of the disk of `root`. An older checkpoint is removed only once
/// a newer one is complete, so the disk needs room for a whole new one whatever
/// `checkpoints.keep_last` says.
pub fn check_room(root: &Path, weights: u64, state: u64, free: u64) -> Result<(), SaveError> {
    // The safetensors headers (about 100 bytes a tensor), the manifest, the small files and
    // their last blocks: well under 64 KiB and a thousandth of the data (7B: 0.2 MB of 27 GB).
    let data = weights + state;
    let need = data + (64 << 10) + data / 1000;
    if need > free {
        return Err(SaveError::NoRoom { root: root.to_path_buf(), weights, state, need, free });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_that_does_not_fit_is_refused_with_what_to_do() {
        let root = Path::new("/data/run/checkpoints");
        assert!(check_room(root, 10 << 30, 20 << 30, 31 << 30).is_ok());
        let e = check_room(root, 13 << 30, 14 << 30, 20 << 30).unwrap_err().to_string();
        for part in [
            "/data/run/checkpoints",
            "27.03 GiB (weights 13.00 GiB, optimizer state 14.00 GiB",
            "20.00 GiB free",
            "train.out_dir",
            "before any step",
        ] {
            assert!(e.contains(part), "{part}: {e}");
        }
    }

    #[test]
    fn free_space_asks_the_nearest_existing_directory() {
        let dir = tempfile::tempdir().unwrap();
        let (below, at) = (free_space(&dir.path().join("not/yet/made")).unwrap(), free_space(dir.path()).unwrap());
        // One disk, asked twice while other tests write to it.
        assert!(below > 0 && below.abs_diff(at) < 1 << 30, "{below} and {at}");
    }
}
