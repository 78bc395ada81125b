//! A counting global allocator: current and peak bytes allocated through Rust's allocator.
//!
//! The process's resident size cannot be used for this: glibc keeps freed pages mapped, so
//! RSS only grows. The `ava` binary (and the tests that measure memory) install
//! [`CountingAlloc`] as `#[global_allocator]`; without it the counters stay at zero and
//! [`installed`] says so.
//!
//! It also stands in for a device running out of memory (`memory.hard_limit`). Rust aborts
//! the process when an allocation fails, so the limit does not fail anything: the first
//! allocation that takes the count over it is remembered ([`take_crossed`]), and the engine
//! checks between micro-steps and abandons the one that crossed, as if it had failed.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// A counter alone on its cache line: every allocation writes `CURRENT`, and sharing its
/// line with the read-mostly counters made threads that allocate a lot (a tokenizer on both
/// cores) wait on each other.
#[repr(align(64))]
struct Line(AtomicU64);

static CURRENT: Line = Line(AtomicU64::new(0));
static PEAK: AtomicU64 = AtomicU64::new(0);
/// While set, nothing is counted (see [`stop_counting`]).
static STOPPED: AtomicBool = AtomicBool::new(false);
/// The hard limit in bytes; 0: none.
static LIMIT: AtomicU64 = AtomicU64::new(0);
/// Bytes in use just after the first allocation that crossed the limit; 0: none since the
/// last [`take_crossed`].
static CROSSED: AtomicU64 = AtomicU64::new(0);

/// The system allocator, counting. Install it in a binary with
/// `#[global_allocator] static A: ava_train::memory::CountingAlloc = ava_train::memory::CountingAlloc;`.
#[derive(Debug, Default, Clone, Copy)]
pub struct CountingAlloc;

#[inline]
fn grew(bytes: u64) {
    if STOPPED.load(Relaxed) {
        return;
    }
    let now = CURRENT.0.fetch_add(bytes, Relaxed) + bytes;
    // A read first: the read-modify-write is only needed when the peak moves.
    if now > PEAK.load(Relaxed) {
        PEAK.fetch_max(now, Relaxed);
    }
    let limit = LIMIT.load(Relaxed);
    if limit != 0 && now > limit {
        // Only the first crossing is kept; later ones find it set.
        let _ = CROSSED.compare_exchange(0, now, Relaxed, Relaxed);
    }
}

// SAFETY: every method forwards to `System` with the same arguments and only adds counting.
#[inline]
fn shrank(bytes: u64) {
    if !STOPPED.load(Relaxed) {
        CURRENT.0.fetch_sub(bytes, Relaxed);
    }
}

/// Stops counting for the rest of the process: for commands that measure no memory and
/// allocate hard on every core (`ava data prepare` spent half its time in the counters).
/// The counts are meaningless afterwards, so there is no way back.
pub fn stop_counting() {
    STOPPED.store(true, Relaxed);
}

unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is passed through unchanged.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size() as u64);
            super::timeline::record(p as usize, layout.size() as i64);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size() as u64);
            super::timeline::record(p as usize, layout.size() as i64);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // Recorded first: once freed, the address can be handed to another thread, whose
        // allocation must come after this release in the timeline.
        super::timeline::record(ptr as usize, -(layout.size() as i64));
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size() as u64);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // The timeline sees the old block go (before its address can be reused, as in
        // dealloc) and the new one come; a failed realloc keeps the old block.
        super::timeline::record(ptr as usize, -(layout.size() as i64));
        // SAFETY: as above.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if p.is_null() {
            super::timeline::record(ptr as usize, layout.size() as i64);
        } else {
            let old = layout.size() as u64;
            let new = new_size as u64;
            if new >= old {
                grew(new - old);
            } else {
                shrank(old - new);
            }
            super::timeline::record(p as usize, new as i64);
        }
        p
    }
}

/// Bytes allocated now.
pub fn current() -> u64 {
    CURRENT.0.load(Relaxed)
}

/// The most bytes allocated at once since the start or the last [`reset_peak`].
pub fn peak() -> u64 {
    PEAK.load(Relaxed)
}

/// Starts a new peak measurement from the current level; returns the old peak.
pub fn reset_peak() -> u64 {
    PEAK.swap(CURRENT.0.load(Relaxed), Relaxed)
}

/// Sets the hard limit (`None`: no limit) and forgets any earlier crossing. The limit is
/// process-wide: one run at a time sets it.
pub fn set_limit(limit: Option<u64>) {
    LIMIT.store(limit.unwrap_or(0), Relaxed);
    CROSSED.store(0, Relaxed);
}

/// The hard limit, if one is set.
pub fn limit() -> Option<u64> {
    Some(LIMIT.load(Relaxed)).filter(|&l| l != 0)
}

/// If an allocation crossed the hard limit since the last call, the bytes in use just after
/// it; the crossing is then forgotten.
pub fn take_crossed() -> Option<u64> {
    Some(CROSSED.swap(0, Relaxed)).filter(|&b| b != 0)
}

/// Whether the counting allocator is the global allocator (any allocation was counted).
pub fn installed() -> bool {
    CURRENT.0.load(Relaxed) > 0 || PEAK.load(Relaxed) > 0
}

/// Bytes the system can still give this process (Linux `MemAvailable`), if known.
pub fn available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
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
