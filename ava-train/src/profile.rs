//! A minimal wall-clock profiler for `ava bench`: named scopes accumulate time while
//! enabled; off (the default) a scope costs one atomic load. With a [`trace`] on, each timed
//! scope is also kept as a span of a timeline (`ava bench train --trace FILE`).
//!
//! A scope's time is the wall clock from its start to its end, nested scopes included in
//! their parent's (a scope inside one of the same name on the same thread adds nothing: it is
//! counted once, by the outer one).
//!
//! On a GPU the clock alone says little: candle launches kernels asynchronously, so a scope
//! around an op ends when its kernels are queued, not when they have run, and the work lands
//! in whichever later scope first waits for the device. [`sync_with`] makes the scopes wait:
//! with a device set (and collection on), a scope synchronizes it before taking its start
//! time and again before reading its end, so each scope's time is the work queued inside it,
//! the device's execution included, attributed to that scope (the work queued before it is
//! charged to whatever enclosed it). Each synchronization costs a round trip and stops the
//! host from running ahead of the device, so synchronized steps are slower than free-running
//! ones: time them apart, and read these totals as where the time goes, not how long a step
//! takes.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use candle_core::Device;

pub mod trace;

static ENABLED: AtomicBool = AtomicBool::new(false);
static TOTALS: Mutex<BTreeMap<&'static str, (Duration, u64)>> = Mutex::new(BTreeMap::new());
/// The device scopes synchronize, if any (read only while collection is on).
static SYNC: Mutex<Option<Device>> = Mutex::new(None);

thread_local! {
    /// The names of the scopes open on this thread that are counting.
    static OPEN: RefCell<Vec<&'static str>> = const { RefCell::new(Vec::new()) };
}

/// Turns collection on or off.
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether collection is on.
pub fn is_enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Makes every scope started from now on synchronize `device` at its start and its end
/// (see the module's documentation), or stops that with `None`. The CPU has nothing queued,
/// so `Some(Device::Cpu)` is the same as `None`. Has no effect while collection is off.
pub fn sync_with(device: Option<Device>) {
    *SYNC.lock().expect("profile lock") = device.filter(|d| !d.is_cpu());
}

/// Clears the totals.
pub fn reset() {
    TOTALS.lock().expect("profile lock").clear();
}

/// Times until dropped.
#[must_use = "the scope is timed until this guard is dropped"]
pub struct Scope {
    name: &'static str,
    start: Option<Instant>,
    /// The device to synchronize before reading the end time.
    sync: Option<Device>,
    /// With a trace on ([`trace`]), the bytes the counting allocator held at the start.
    held: Option<u64>,
    /// With a memory timeline armed, this scope owns what is allocated until it ends.
    _owner: Option<crate::memory::timeline::OwnerGuard>,
}

/// Starts timing `name`.
pub fn scope(name: &'static str) -> Scope {
    if !ENABLED.load(Ordering::Relaxed) || OPEN.with_borrow(|open| open.contains(&name)) {
        return Scope { name, start: None, sync: None, held: None, _owner: None };
    }
    let sync = SYNC.lock().expect("profile lock").clone();
    wait_for(sync.as_ref());
    OPEN.with_borrow_mut(|open| open.push(name));
    let held = trace::is_on().then(crate::memory::current);
    let _owner = crate::memory::timeline::enter(name);
    Scope { name, start: Some(Instant::now()), sync, held, _owner }
}

/// Waits until `device` has run everything queued on it. An error is not the profiler's to
/// report: a failed synchronization means an earlier launch failed, and candle returns the
/// same sticky error from the op's own next call, which the step reports with its context;
/// the time measured then is of a step that fails anyway.
fn wait_for(device: Option<&Device>) {
    if let Some(device) = device {
        let _ = device.synchronize();
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        if let Some(start) = self.start {
            wait_for(self.sync.as_ref());
            let elapsed = start.elapsed();
            OPEN.with_borrow_mut(|open| {
                if let Some(i) = open.iter().rposition(|n| *n == self.name) {
                    open.remove(i);
                }
            });
            let mut t = TOTALS.lock().expect("profile lock");
            let e = t.entry(self.name).or_default();
            e.0 += elapsed;
            e.1 += 1;
            drop(t);
            if let Some(held) = self.held {
                trace::record(std::borrow::Cow::Borrowed(self.name), start, held);
            }
        }
    }
}

/// (name, total time, calls), most expensive first.
pub fn totals() -> Vec<(&'static str, Duration, u64)> {
    let mut v: Vec<_> = TOTALS.lock().expect("profile lock").iter().map(|(k, (d, n))| (*k, *d, *n)).collect();
    v.sort_by_key(|e| std::cmp::Reverse(e.1));
    v
}

/// The widest x86 vector instruction set this binary was compiled for, and the widest the
/// running CPU has. The half-precision paths' conversions vectorize only as wide as the
/// former (see `.cargo/config.toml`), so a gap between the two is speed left unused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct VectorIsa {
    /// What the compiler was allowed to use.
    pub built: &'static str,
    /// What this CPU offers.
    pub cpu: &'static str,
}

/// See [`VectorIsa`].
pub fn vector_isa() -> VectorIsa {
    let built = if cfg!(target_feature = "avx512f") {
        "AVX-512"
    } else if cfg!(target_feature = "avx2") {
        "AVX2"
    } else if cfg!(target_arch = "x86_64") {
        "SSE2"
    } else {
        std::env::consts::ARCH
    };
    #[cfg(target_arch = "x86_64")]
    let cpu = if std::arch::is_x86_feature_detected!("avx512f") {
        "AVX-512"
    } else if std::arch::is_x86_feature_detected!("avx2") {
        "AVX2"
    } else {
        "SSE2"
    };
    #[cfg(not(target_arch = "x86_64"))]
    let cpu = std::env::consts::ARCH;
    VectorIsa { built, cpu }
}

/// The CPU matrix kernels this machine runs, in words (`ava bench train` prints it): the
/// `gemm` crate's level (it picks its kernels at run time: on x86-64 AVX-512 where the CPU
/// has x86-64-v4, else AVX2 + FMA, else portable), how half-precision products are multiplied,
/// and the attention kernels' tile products.
pub fn matmul_path() -> String {
    #[cfg(target_arch = "x86_64")]
    let (gemm, tiles) = {
        use crate::model::fused::{GemmIsa, gemm_isa};
        let gemm = match gemm_isa() {
            GemmIsa::Avx512 => "AVX-512 (x86-64-v4)",
            GemmIsa::Avx2 => "AVX2 + FMA",
            GemmIsa::Other => "portable",
        };
        let tiles = if ava_kernels::rows::has_avx512() {
            "AVX-512"
        } else if ava_kernels::rows::has_avx2() {
            "AVX2"
        } else {
            "gemm"
        };
        (gemm, tiles)
    };
    // Elsewhere gemm picks the architecture's own kernels (NEON on aarch64).
    #[cfg(not(target_arch = "x86_64"))]
    let (gemm, tiles) = (std::env::consts::ARCH, "gemm");
    format!("gemm {gemm}, f32; bf16/f16 widened to f32 and rounded once; attention tiles {tiles}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn calls(name: &str) -> Option<u64> {
        totals().into_iter().find(|(n, ..)| *n == name).map(|(_, _, calls)| calls)
    }

    /// Off, a scope records nothing; on, a scope inside one of the same name (the engine's
    /// attention op opens its backward scope, then its GPU branch opens it again) is counted
    /// once, by the outer one, and other nested names count on their own. The CPU as the
    /// device to synchronize is no device.
    #[test]
    fn scopes_count_once_per_name_and_only_while_enabled() {
        drop(scope("profile test: off"));
        enable(true);
        sync_with(Some(Device::Cpu));
        assert!(SYNC.lock().unwrap().is_none());
        {
            let _outer = scope("profile test: outer");
            let inner = scope("profile test: outer");
            assert!(inner.start.is_none(), "the same name nested is not timed twice");
            drop(inner);
            drop(scope("profile test: inner"));
        }
        drop(scope("profile test: outer"));
        enable(false);
        assert_eq!(calls("profile test: off"), None);
        assert_eq!(calls("profile test: outer"), Some(2));
        assert_eq!(calls("profile test: inner"), Some(1));
    }
}
