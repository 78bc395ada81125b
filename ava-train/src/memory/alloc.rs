//! A counting global allocator: current and peak bytes allocated through Rust's allocator.
//!
//! The process's resident size cannot be used for this: glibc keeps freed pages mapped, so
//! RSS only grows. The `ava` binary (and the tests that measure memory) install
//! [`CountingAlloc`] as `#[global_allocator]`; without it the counters stay at zero and
//! [`installed`] says so.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

static CURRENT: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

/// The system allocator, counting. Install it in a binary with
/// `#[global_allocator] static A: ava_train::memory::CountingAlloc = ava_train::memory::CountingAlloc;`.
#[derive(Debug, Default, Clone, Copy)]
pub struct CountingAlloc;

#[inline]
fn grew(bytes: u64) {
    let now = CURRENT.fetch_add(bytes, Relaxed) + bytes;
    PEAK.fetch_max(now, Relaxed);
}

// SAFETY: every method forwards to `System` with the same arguments and only adds counting.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is passed through unchanged.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size() as u64);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size() as u64);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size() as u64, Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            let old = layout.size() as u64;
            let new = new_size as u64;
            if new >= old {
                grew(new - old);
            } else {
                CURRENT.fetch_sub(old - new, Relaxed);
            }
        }
        p
    }
}

/// Bytes allocated now.
pub fn current() -> u64 {
    CURRENT.load(Relaxed)
}

/// The most bytes allocated at once since the start or the last [`reset_peak`].
pub fn peak() -> u64 {
    PEAK.load(Relaxed)
}

/// Starts a new peak measurement from the current level; returns the old peak.
pub fn reset_peak() -> u64 {
    PEAK.swap(CURRENT.load(Relaxed), Relaxed)
}

/// Whether the counting allocator is the global allocator (any allocation was counted).
pub fn installed() -> bool {
    CURRENT.load(Relaxed) > 0 || PEAK.load(Relaxed) > 0
}

/// The process's resident set size in bytes (Linux `/proc/self/statm`), if readable: what
/// the OS has reserved for us, against which the allocated bytes give the fragmentation.
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * if page > 0 { page as u64 } else { 4096 })
}
