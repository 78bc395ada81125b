//! File I/O for records: buffers aligned for `O_DIRECT`, whole-record writes that treat a
//! short write as an error, reads to the end of the file, the direct-I/O probe and the
//! filesystem's free space.

use std::{
    alloc::{Layout, alloc_zeroed, dealloc},
    fs::{File, OpenOptions},
    io,
    os::unix::fs::{FileExt, OpenOptionsExt},
    path::Path,
    ptr::NonNull,
};

use crate::record::ALIGN;

/// A zero-filled byte buffer aligned to [`ALIGN`], its capacity a multiple of it.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: the buffer owns its allocation outright, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access is read-only (`&[u8]`).
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` zero bytes, with capacity rounded up to [`ALIGN`].
    pub fn zeroed(len: usize) -> Self {
        let cap = len.next_multiple_of(ALIGN).max(ALIGN);
        let layout = Layout::from_size_align(cap, ALIGN).expect("a valid layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, len, cap }
    }

    /// Bytes in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no byte is in use.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes allocated.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The whole allocation, for reading into.
    fn spare(&mut self) -> &mut [u8] {
        // SAFETY: `cap` bytes were allocated and zero-filled.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len <= cap` bytes were allocated and initialised.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.cap, ALIGN).expect("the layout it was allocated with");
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// Opens a record file: never through a link (`O_NOFOLLOW`), a new one readable by this
/// user alone (0600).
fn open(path: &Path, direct: bool, write: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    let mut flags = libc::O_NOFOLLOW;
    if write {
        o.write(true).create(true).truncate(true).mode(0o600);
    } else {
        // Non-blocking: a FIFO put in place of a record must not hang `open`.
        o.read(true);
        flags |= libc::O_NONBLOCK;
    }
    if direct {
        flags |= libc::O_DIRECT;
    }
    o.custom_flags(flags).open(path)
}

/// Writes `buf` (aligned, its length a multiple of [`ALIGN`] under direct I/O) as the whole
/// of the file at `path`. A write that makes no progress is a short write, an error; so is
/// a file whose length afterwards is not the buffer's.
pub fn write_file(path: &Path, buf: &[u8], direct: bool) -> io::Result<()> {
    let file = open(path, direct, true)?;
    let mut done = 0;
    while done < buf.len() {
        match file.write_at(&buf[done..], done as u64) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    format!("short write: {done} of {} bytes written", buf.len()),
                ));
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = file.metadata()?.len();
    if len != buf.len() as u64 {
        return Err(io::Error::other(format!("short write: the file has {len} bytes, {} were written", buf.len())));
    }
    Ok(())
}

/// Reads the whole file at `path` into an aligned buffer. The file must be a regular file of
/// at most `max_len` bytes (the record stored there): its size on disk, which anyone who can
/// write the directory controls, never sizes an allocation past that.
pub fn read_file(path: &Path, direct: bool, max_len: u64) -> io::Result<AlignedBuf> {
    let file = open(path, direct, false)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "not a regular file (was it replaced?)"));
    }
    if meta.len() > max_len {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the file has {} bytes, more than the {max_len} bytes of the record stored there", meta.len()),
        ));
    }
    let len = meta.len() as usize;
    let mut buf = AlignedBuf::zeroed(len);
    let mut done = 0;
    {
        // Direct reads need aligned lengths: read into the whole (aligned) allocation.
        let spare = buf.spare();
        while done < len {
            match file.read_at(&mut spare[done..], done as u64) {
                Ok(0) => break, // the file shrank while read: decode reports it as truncated
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
    buf.len = done.min(len);
    Ok(buf)
}

/// Whether files in `dir` can be written and read back with `O_DIRECT`: the error if not.
pub fn probe_direct(dir: &Path) -> io::Result<()> {
    let path = dir.join(".direct-io-probe");
    let mut buf = AlignedBuf::zeroed(ALIGN);
    buf[..8].copy_from_slice(b"AVAPROBE");
    let result = write_file(&path, &buf, true).and_then(|()| {
        let back = read_file(&path, true, ALIGN as u64)?;
        if back[..] == buf[..] { Ok(()) } else { Err(io::Error::other("the bytes read back differ")) }
    });
    let _ = std::fs::remove_file(&path);
    result
}

/// Bytes an unprivileged process may still write on the filesystem of `dir`.
pub fn free_space(dir: &Path) -> io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a valid C string and `st` has room for the result.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statvfs succeeded and filled it.
    let st = unsafe { st.assume_init() };
    #[allow(clippy::unnecessary_cast)] // the field types differ between platforms
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buffers_are_aligned_and_zeroed() {
        for len in [0, 1, 4095, 4096, 4097] {
            let b = AlignedBuf::zeroed(len);
            assert_eq!(b.as_ptr() as usize % ALIGN, 0);
            assert_eq!((b.len(), b.capacity() % ALIGN), (len, 0));
            assert!(b.iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn buffered_round_trip_and_free_space() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r");
        let data: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        write_file(&path, &data, false).unwrap();
        assert_eq!(&read_file(&path, false, 1 << 20).unwrap()[..], &data[..]);
        assert!(free_space(dir.path()).unwrap() > 0);
    }

    /// Issue 20: a record file replaced by a FIFO or by a larger file is an error, without
    /// blocking and without an allocation sized by the file.
    #[test]
    fn a_replaced_record_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rec");
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let Err(e) = read_file(&path, false, 4096) else { panic!("read") };
        assert!(e.to_string().contains("not a regular file"), "{e}");
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let Err(e) = read_file(&path, false, 4096) else { panic!("read") };
        assert!(e.to_string().contains("the file has 8192 bytes, more than the 4096 bytes"), "{e}");
    }
}
