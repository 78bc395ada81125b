//! A minimal wall-clock profiler for `ava bench`: named scopes accumulate time while
//! enabled; off (the default) a scope costs one atomic load.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

static ENABLED: AtomicBool = AtomicBool::new(false);
static TOTALS: Mutex<BTreeMap<&'static str, (Duration, u64)>> = Mutex::new(BTreeMap::new());

/// Turns collection on or off.
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
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
}

/// Starts timing `name`.
pub fn scope(name: &'static str) -> Scope {
    Scope { name, start: ENABLED.load(Ordering::Relaxed).then(Instant::now) }
}

impl Drop for Scope {
    fn drop(&mut self) {
        if let Some(start) = self.start {
            let mut t = TOTALS.lock().expect("profile lock");
            let e = t.entry(self.name).or_default();
            e.0 += start.elapsed();
            e.1 += 1;
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
