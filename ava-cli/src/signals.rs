//! Ctrl-C without losing work: the first SIGINT, SIGTERM or SIGHUP sets the stop flag the
//! trainer checks between steps (it finishes the step under way and saves a checkpoint),
//! and says so at once; the waits outside a step's work (the data loader, the other ranks
//! of an in-process group) look at the flag too and give up within a second. A second one
//! says what it does, restores the default action and raises the signal again, so the
//! process stops at once. The handlers live here, in the binary: the training library only
//! reads a flag.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// The flag the trainer reads; set once, before the handlers are installed.
static STOP: OnceLock<Arc<AtomicBool>> = OnceLock::new();
/// The first signal received (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);
/// The step under way (0: not known), for the answer to the first signal.
static UNDER_WAY: AtomicU64 = AtomicU64::new(0);

/// The signals that ask a run to stop.
const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// Tells the handlers which step is under way (the reporter calls it as each step starts).
pub fn step_under_way(step: u64) {
    UNDER_WAY.store(step, Ordering::Relaxed);
}

/// Writes `parts` to stderr with `write(2)` and no allocation: async-signal-safe.
fn say(parts: &[&[u8]]) {
    for part in parts {
        // SAFETY: write(2) on stderr with a valid buffer; async-signal-safe.
        unsafe { libc::write(2, part.as_ptr().cast(), part.len()) };
    }
}

/// `n` in decimal into `buf`, without allocating; returns the digits.
fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[i..];
        }
    }
}

/// The signal's name as bytes, for the handler's messages.
fn name_bytes(signal: libc::c_int) -> &'static [u8] {
    name(signal).as_bytes()
}

/// Only async-signal-safe work: atomics, `write`, `signal` and `raise`. Each signal is
/// answered at once on stderr, so a long step does not look like a hang.
extern "C" fn on_signal(signal: libc::c_int) {
    if RECEIVED.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst).is_err() {
        // The second signal: stop now, as the default action does (the kernel releases the
        // run directory's lock; a half-written checkpoint is a `.tmp-` directory that the
        // next save removes, and `latest` still names the last complete one).
        say(&[
            b"\n",
            name_bytes(signal),
            b" again: quitting now, without saving this step; the last complete checkpoint is intact \
              (resume it with --resume latest)\n",
        ]);
        // SAFETY: both are async-signal-safe; the signal is blocked while this handler
        // runs, so it is delivered, with the default action, as the handler returns.
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
            libc::raise(signal);
        }
        return;
    }
    if let Some(stop) = STOP.get() {
        stop.store(true, Ordering::SeqCst);
    }
    let mut buf = [0u8; 20];
    let step = UNDER_WAY.load(Ordering::Relaxed);
    let which: &[u8] = if step == 0 { b"the step under way" } else { decimal(step, &mut buf) };
    say(&[
        b"\n",
        name_bytes(signal),
        b": stopping after step ",
        which,
        b" (or within a second, before it, if it is stuck waiting for data or for another rank), then saving a \
          checkpoint; Ctrl-C again to quit at once without saving\n",
    ]);
}

/// Installs the handlers and returns the flag they set.
pub fn install() -> Arc<AtomicBool> {
    let stop = STOP.get_or_init(|| Arc::new(AtomicBool::new(false))).clone();
    for signal in SIGNALS {
        // SAFETY: a zeroed sigaction is valid; the handler only touches atomics and calls
        // async-signal-safe functions. SA_RESTART: reads and writes interrupted by the
        // signal are restarted rather than failing with EINTR.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
    stop
}

/// The first signal received, if any.
pub fn received() -> Option<i32> {
    Some(RECEIVED.load(Ordering::SeqCst)).filter(|&s| s != 0)
}

/// The signal's name, for messages.
pub fn name(signal: i32) -> &'static str {
    match signal {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}

#[cfg(test)]
mod tests {
    use super::decimal;

    #[test]
    fn decimals_are_written_without_allocating() {
        let mut buf = [0u8; 20];
        assert_eq!(decimal(0, &mut buf), b"0");
        assert_eq!(decimal(1207, &mut buf), b"1207");
        assert_eq!(decimal(u64::MAX, &mut buf), b"18446744073709551615");
    }
}
