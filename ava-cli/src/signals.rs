//! Ctrl-C without losing work: the first SIGINT, SIGTERM or SIGHUP sets the stop flag the
//! trainer checks between steps (it finishes the step under way and saves a checkpoint); a
//! second one restores the default action and raises the signal again, so the process stops
//! at once. The handlers live here, in the binary: the training library only reads a flag.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, OnceLock};

/// The flag the trainer reads; set once, before the handlers are installed.
static STOP: OnceLock<Arc<AtomicBool>> = OnceLock::new();
/// The first signal received (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);

/// The signals that ask a run to stop.
const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// Only async-signal-safe work: atomics, `signal` and `raise`.
extern "C" fn on_signal(signal: libc::c_int) {
    if RECEIVED.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst).is_err() {
        // The second signal: stop now, as the default action does (the kernel releases the
        // run directory's lock; a half-written checkpoint is a `.tmp-` directory that the
        // next save removes, and `latest` still names the last complete one).
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
