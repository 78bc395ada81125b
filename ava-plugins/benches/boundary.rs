//! What the plugin boundary costs: loading a library, and one trait call through the
//! abi_stable trait object (with its panic guard) against the same call made directly.
//!
//! Run: `cargo bench -p ava-plugins --bench boundary` (builds the lion plugin in release
//! first if it is missing).

use std::{path::PathBuf, process::Command, sync::OnceLock};

use ava_core::{DType, Optimizer, Options, ParamInfo, Plugin, StateBuf, StepContext};
use ava_plugin_lion::Lion;
use ava_plugins::{HostConfig, Registry};

fn main() {
    divan::main();
}

/// target/release, with the lion plugin built in it.
fn plugin_dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "--release", "-p", "ava-plugin-lion"])
            .current_dir(&root)
            .status()
            .expect("run cargo");
        assert!(status.success(), "building the lion plugin failed");
        // Only the lion library, so the load time is one plugin's.
        let dir = std::env::temp_dir().join(format!("ava-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let name = format!("{}ava_plugin_lion{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX);
        std::fs::copy(target.join("release").join(&name), dir.join(&name)).unwrap();
        dir
    })
}

fn registry() -> Registry {
    let cfg = HostConfig {
        search_paths: vec![plugin_dir().clone()],
        lock_file: plugin_dir().join("none.lock"),
        ..HostConfig::default()
    };
    Registry::load(&cfg).unwrap()
}

/// Discovery + read + sha256 + private copy + dlopen + layout check + manifest of one plugin
/// (plus the built-ins, which cost microseconds).
#[divan::bench(sample_count = 20)]
fn load_one_plugin() -> Registry {
    registry()
}

const SIZES: [usize; 3] = [1, 1024, 1 << 20];

fn step_bench(b: divan::Bencher, n: usize, mut opt: Box<dyn Optimizer>) {
    let shape = [n as u64];
    let mut w = vec![0.5f32; n];
    let g = vec![0.1f32; n];
    let mut m = vec![0u8; 4 * n];
    let ctx = StepContext { step: 1, lr: 1e-4, weight_decay: 0.0, threads: 1, grad_scale: 1.0 };
    b.counter(divan::counter::ItemsCount::new(n)).bench_local(|| {
        let info = ParamInfo::new("w", &shape);
        let mut state = [StateBuf::new(DType::F32, &mut m)];
        opt.step(&info, &mut w, &g, &mut state, &ctx).unwrap();
    });
}

/// Lion's step called directly (the plugin crate linked as an rlib).
#[divan::bench(args = SIZES)]
fn lion_step_direct(b: divan::Bencher, n: usize) {
    let lion = Lion::from_options(Options::defaults(&Lion::manifest())).unwrap();
    step_bench(b, n, Box::new(lion));
}

/// The same step through the dynamically loaded library.
#[divan::bench(args = SIZES)]
fn lion_step_dynamic(b: divan::Bencher, n: usize) {
    let reg = registry();
    step_bench(b, n, reg.optimizer("lion", "").unwrap());
}
