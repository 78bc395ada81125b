//! Where a run computes: `train.device` (`cpu`, `cuda` or `cuda:N`), parsed once
//! ([`DeviceSpec`]) and opened by the engine's first stage ([`open`]) before anything
//! model-sized is allocated.
//!
//! A build without the `cuda` cargo feature knows the words but cannot open a GPU: it says
//! how to build one. A `cuda` build opens the device through candle (cudarc loads the driver
//! at run time), so a machine without a GPU or driver, or an ordinal past the last GPU, is an
//! error naming the key. Then [`check_run`] refuses, all at once and by name, what a GPU run
//! does not do yet (several ranks, state streamed from both host memory and a tier at once)
//! and the selected plugins that take no device buffers: Ava never copies to the host behind
//! the user's back. Every `train.master_weights` runs there: f32 masters or Kahan's
//! compensation are state buffers, on the device or streamed with the optimizer state.
//!
//! `memory.hard_limit` on a GPU run caps the device memory the run's allocations may hold
//! ([`limit`]): checked against the card's size ([`check_limit`]), then a memory pool of that
//! size becomes the device's current pool before the model moves there, so a run under
//! `hard_limit: 24GiB` on an 80 GiB card runs out where a 24 GiB card's pool would. The
//! returned [`DeviceLimit`] holds the pool for the run. `memory.budget`'s default on a GPU
//! run is the card's memory less [`card_margin`] ([`card_budget`]), and not more than the
//! hard limit ([`default_budget`]).

use std::fmt;
use std::str::FromStr;

use ava_core::PluginKind;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::config::Config;

/// `train.device` as written in a config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// The host's cores.
    #[default]
    Cpu,
    /// The NVIDIA GPU of this ordinal (`cuda` is `cuda:0`).
    Cuda(usize),
}

/// The forms `train.device` accepts, for messages.
pub const DEVICE_FORMS: &str = "cpu, cuda or cuda:N (N the GPU's ordinal, from 0)";

impl DeviceSpec {
    /// Parses `cpu`, `cuda` or `cuda:N`; the error says what is accepted.
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = || format!("'{text}' is not a device: write {DEVICE_FORMS}");
        match text {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => {
                let ordinal = text.strip_prefix("cuda:").ok_or_else(bad)?;
                // Digits only: `cuda:+1`, `cuda: 1` and `cuda:0x1` are typos, not ordinals.
                if ordinal.is_empty() || !ordinal.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                ordinal.parse().map(Self::Cuda).map_err(|_| bad())
            }
        }
    }

    /// Whether this is a GPU.
    pub fn is_cuda(self) -> bool {
        matches!(self, Self::Cuda(_))
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::parse(s)
    }
}

impl Serialize for DeviceSpec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Self::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// Why `train.device` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A GPU was asked of a build without the `cuda` feature.
    #[error(
        "train.device: {spec}: this ava was built without CUDA. Build one with `cargo build --release --features \
         cuda` (a CUDA 12.4+ toolkit, and CUDA_COMPUTE_CAP for the card: 80 A100, 89 RTX 4090, 90 H100; on a \
         machine without a toolkit, `source tools/cuda-build-env.sh` first), or set train.device: cpu"
    )]
    NotBuilt {
        /// The device asked for.
        spec: DeviceSpec,
    },
    /// The CUDA driver could not open the device.
    #[error(
        "train.device: {spec}: the GPU could not be opened ({reason}). Check that `nvidia-smi` lists a GPU {ordinal} \
         (ordinals start at 0), that the NVIDIA driver and the CUDA libraries are installed (LD_LIBRARY_PATH, e.g. \
         /usr/local/cuda/lib64), or set train.device: cpu",
        ordinal = match spec { DeviceSpec::Cuda(n) => *n, DeviceSpec::Cpu => 0 }
    )]
    Open {
        /// The device asked for.
        spec: DeviceSpec,
        /// What the driver said.
        reason: String,
    },
    /// `memory.hard_limit` is more than the card has: a limit cannot make the card larger.
    #[error(
        "memory.hard_limit: {limit} is more than the {} of memory {spec} has; the limit caps the device memory the \
         run's allocations may hold, so it can make the card smaller, not larger: set memory.hard_limit to at most \
         {}MiB (or 0 for no limit)",
        ava_core::format_size(*card_total),
        card_total >> 20
    )]
    LimitPastCard {
        /// The device asked for.
        spec: DeviceSpec,
        /// `memory.hard_limit`.
        limit: crate::config::ByteSize,
        /// The card's memory (`cuMemGetInfo`'s total).
        card_total: u64,
    },
    /// The driver would not make the pool that caps the device's memory.
    #[error(
        "memory.hard_limit: {limit} cannot cap the memory of {spec} ({reason}); a capped pool needs a driver for \
         CUDA 12.2 or later (`nvidia-smi` shows its CUDA version) on a GPU with stream-ordered memory pools: update \
         the driver, or remove memory.hard_limit"
    )]
    Limit {
        /// The device asked for.
        spec: DeviceSpec,
        /// `memory.hard_limit`.
        limit: crate::config::ByteSize,
        /// What the driver said.
        reason: String,
    },
    /// The GPU opened, but the run asks for what a GPU run does not do (yet), or selects
    /// plugins that take no device buffers.
    #[error("train.device: {spec} cannot run this configuration:\n  - {}", problems.join("\n  - "))]
    Unsupported {
        /// The device asked for.
        spec: DeviceSpec,
        /// Every problem, each with what to change.
        problems: Vec<String>,
    },
}

/// Opens the device a run computes on: the first stage of the engine, before anything
/// model-sized is allocated.
pub fn open(spec: DeviceSpec) -> Result<candle_core::Device, DeviceError> {
    match spec {
        DeviceSpec::Cpu => Ok(candle_core::Device::Cpu),
        DeviceSpec::Cuda(ordinal) => open_cuda(spec, ordinal),
    }
}

/// What a run of `world` ranks with `config` asks of its device that it cannot give, all
/// problems at once: on the CPU nothing; on a GPU several ranks and state streamed from two
/// places at once, and the selected optimizer and attention kernel unless their
/// manifests list the GPU (`registry`, [`ava_plugins::Registry::check_devices`]).
pub fn check_run(config: &Config, world: usize, registry: &ava_plugins::Registry) -> Result<(), DeviceError> {
    check(config, world, Some(registry))
}

/// [`check_run`] without the plugins: what a GPU run of `world` ranks with `config` refuses
/// whatever plugins it selects. For a build without CUDA, whose plugins' manifests list only
/// the CPU (`ava estimate --device cuda` there estimates the GPU engine all the same).
pub fn check_modes(config: &Config, world: usize) -> Result<(), DeviceError> {
    check(config, world, None)
}

fn check(config: &Config, world: usize, registry: Option<&ava_plugins::Registry>) -> Result<(), DeviceError> {
    let spec = config.train.device;
    if !spec.is_cuda() {
        return Ok(());
    }
    let mut problems = Vec::new();
    if world > 1 {
        problems.push(format!(
            "{world} ranks: distributed training runs on the CPU only for now; run one process, or set \
             train.device: cpu"
        ));
    }
    let tiers = &config.offload.tiers;
    if let Some(tier) = tiers.offloaded().filter(|_| tiers.pinned(true) > 0.0) {
        problems.push(format!(
            "offload.tiers: on a GPU run the state streams from one place, but this names both ram (page-locked host \
             memory) and the tier '{}'; keep one (offload.tiers: [device: {}%, ram: {}%] or [device: {}%, {}: {}%])",
            tier.name,
            percent(tiers.resident(true)),
            percent(1.0 - tiers.resident(true)),
            percent(tiers.resident(true)),
            tier.name,
            percent(1.0 - tiers.resident(true)),
        ));
    }
    let selected = [
        (PluginKind::Optimizer, config.plugins.optimizer.name.as_str()),
        (PluginKind::Attention, config.plugins.attention.name.as_str()),
    ];
    if let Some(Err(plugins)) = registry.map(|r| r.check_devices(&selected, ava_core::Device::Cuda)) {
        problems.extend(plugins);
    }
    if problems.is_empty() { Ok(()) } else { Err(DeviceError::Unsupported { spec, problems }) }
}

/// A fraction as a percentage for a message: `30`, `12.5`.
fn percent(fraction: f64) -> f64 {
    (fraction * 1e6).round() / 1e4
}

/// `memory.hard_limit` on a GPU run, in force while held: the device's allocations come from
/// a pool of at most [`bytes`](Self::bytes) (a `cuda` build's
/// [`CappedPool`](crate::memory::device::CappedPool)). Dropping it destroys the pool, which
/// gives the device its default pool back; the trainer holds it for as long as the run, and
/// drops it after the run's tensors.
#[derive(Debug)]
pub struct DeviceLimit {
    bytes: u64,
    #[cfg(feature = "cuda")]
    _pool: crate::memory::device::CappedPool,
}

impl DeviceLimit {
    /// `memory.hard_limit`, in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// Caps what `device`'s allocations may hold at `config`'s `memory.hard_limit`, before
/// anything of the run is on the device: `None` on the CPU (where the counting allocator
/// enforces the limit) and without a limit. A limit past the card's memory is refused
/// ([`check_limit`]); so is a driver that cannot make a capped pool.
pub fn limit(device: &candle_core::Device, config: &Config) -> Result<Option<DeviceLimit>, DeviceError> {
    let bytes = config.memory.hard_limit.0;
    if bytes == 0 || device.is_cpu() {
        return Ok(None);
    }
    limit_cuda(device, config.train.device, bytes)
}

#[cfg(feature = "cuda")]
fn limit_cuda(device: &candle_core::Device, spec: DeviceSpec, bytes: u64) -> Result<Option<DeviceLimit>, DeviceError> {
    let candle_core::Device::Cuda(gpu) = device else { return Ok(None) };
    let limit = crate::config::ByteSize(bytes);
    let card_total =
        crate::memory::device::read(gpu).map_err(|e| DeviceError::Open { spec, reason: e.to_string() })?.card_total;
    check_limit(spec, bytes, card_total)?;
    let pool = crate::memory::device::CappedPool::new(gpu, bytes).map_err(|reason| DeviceError::Limit {
        spec,
        limit,
        reason,
    })?;
    Ok(Some(DeviceLimit { bytes, _pool: pool }))
}

#[cfg(not(feature = "cuda"))]
fn limit_cuda(_: &candle_core::Device, spec: DeviceSpec, _: u64) -> Result<Option<DeviceLimit>, DeviceError> {
    Err(DeviceError::NotBuilt { spec })
}

/// Whether `memory.hard_limit` (`limit` bytes, not 0) can cap a card of `card_total` bytes:
/// up to the card's whole memory (what lives outside the run's pool, the context and
/// cuBLAS's workspace, then competes with it as on any card).
pub fn check_limit(spec: DeviceSpec, limit: u64, card_total: u64) -> Result<(), DeviceError> {
    if limit > card_total {
        return Err(DeviceError::LimitPastCard { spec, limit: crate::config::ByteSize(limit), card_total });
    }
    Ok(())
}

/// `memory.budget`'s default on a GPU run from the card's ([`card_budget`]) and
/// `memory.hard_limit` (0: none): the card's, but not more than the limit. The budget is
/// compared with the run's pool, which the limit caps, so a card made smaller by the limit
/// gets the limit as its budget (the context and cuBLAS's workspace, which [`card_margin`]
/// leaves room for, live outside the pool).
pub fn default_budget(card_budget: u64, hard_limit: u64) -> u64 {
    if hard_limit > 0 { card_budget.min(hard_limit) } else { card_budget }
}

#[cfg(feature = "cuda")]
fn open_cuda(spec: DeviceSpec, ordinal: usize) -> Result<candle_core::Device, DeviceError> {
    // cudarc panics (rather than erring) when it cannot load the driver library at all.
    let opened = std::panic::catch_unwind(|| candle_core::Device::new_cuda(ordinal));
    match opened {
        Ok(Ok(device)) => {
            // The pool keeps what a step freed for the next one (memory::device::keep_reserve).
            if let candle_core::Device::Cuda(gpu) = &device {
                crate::memory::device::keep_reserve(gpu)
                    .map_err(|e| DeviceError::Open { spec, reason: e.to_string() })?;
            }
            Ok(device)
        }
        Ok(Err(e)) => Err(DeviceError::Open { spec, reason: e.to_string() }),
        Err(panic) => {
            let reason = ava_core::ffi::panic_message(panic.as_ref())
                .unwrap_or_else(|| "the CUDA driver library could not be loaded".into());
            Err(DeviceError::Open { spec, reason })
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(spec: DeviceSpec, _ordinal: usize) -> Result<candle_core::Device, DeviceError> {
    Err(DeviceError::NotBuilt { spec })
}

/// The part of a card's memory `memory.budget` leaves out by default: the CUDA context,
/// cuBLAS's workspace and the pool's slack live outside the run's allocations (1.2 GiB on an
/// H200 running TinyLlama-1.1B's shape: the card's figure less the pool's peak), so 5% of the
/// card, at least 2 GiB.
pub fn card_margin(card_total: u64) -> u64 {
    (card_total / 20).max(2 << 30)
}

/// `memory.budget`'s default on a GPU run: the card's memory (`cuMemGetInfo`'s total) less
/// [`card_margin`]. `None` on the CPU, where the config's default stands.
pub fn card_budget(spec: DeviceSpec) -> Result<Option<(u64, u64)>, DeviceError> {
    if !spec.is_cuda() {
        return Ok(None);
    }
    let total = card_total(spec)?;
    Ok(Some((total.saturating_sub(card_margin(total)), total)))
}

#[cfg(feature = "cuda")]
fn card_total(spec: DeviceSpec) -> Result<u64, DeviceError> {
    let candle_core::Device::Cuda(gpu) = open(spec)? else { unreachable!("a cuda spec opens a GPU") };
    crate::memory::device::read(&gpu)
        .map(|m| m.card_total)
        .map_err(|e| DeviceError::Open { spec, reason: e.to_string() })
}

#[cfg(not(feature = "cuda"))]
fn card_total(spec: DeviceSpec) -> Result<u64, DeviceError> {
    Err(DeviceError::NotBuilt { spec })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{MasterWeights, TierShare, Tiers};

    #[test]
    fn the_budget_leaves_five_percent_of_a_card_and_at_least_two_gib() {
        const GIB: u64 = 1 << 30;
        assert_eq!(card_margin(140 * GIB), 7 * GIB); // an H200
        assert_eq!(card_margin(80 * GIB), 4 * GIB); // an H100
        assert_eq!(card_margin(24 * GIB), 2 * GIB); // an RTX 4090
        assert!(matches!(card_budget(DeviceSpec::Cpu), Ok(None)));
    }

    #[test]
    fn the_three_forms_parse_and_print_back() {
        assert_eq!(DeviceSpec::parse("cpu"), Ok(DeviceSpec::Cpu));
        assert_eq!(DeviceSpec::parse("cuda"), Ok(DeviceSpec::Cuda(0)));
        assert_eq!(DeviceSpec::parse("cuda:3"), Ok(DeviceSpec::Cuda(3)));
        assert_eq!(DeviceSpec::Cuda(3).to_string(), "cuda:3");
        assert_eq!(DeviceSpec::Cuda(0).to_string(), "cuda:0");
        assert_eq!(DeviceSpec::default(), DeviceSpec::Cpu);
    }

    #[test]
    fn anything_else_is_refused_with_the_forms() {
        for text in ["gpu", "CUDA", "cuda:", "cuda:-1", "cuda:+1", "cuda: 1", "cuda:0x1", "cuda:1.0", "", "cpu:0"] {
            let e = DeviceSpec::parse(text).unwrap_err();
            assert_eq!(e, format!("'{text}' is not a device: write {DEVICE_FORMS}"));
        }
        assert!(DeviceSpec::parse("cuda:99999999999999999999999").is_err());
    }

    /// A GPU run's refusals, all at once, each naming its key and what to change; checked
    /// without opening a GPU. `memory.hard_limit` is not one of them: it caps the device.
    #[test]
    fn a_gpu_run_refuses_every_host_only_setting_at_once() {
        let mut config = Config::default();
        config.train.device = DeviceSpec::Cuda(0);
        let registry = ava_plugins::Registry::builtins();
        assert!(check_run(&config, 1, &registry).is_ok() == cfg!(feature = "cuda"), "the default config");

        config.memory.hard_limit = crate::config::ByteSize(8 << 30);
        let share = |name: &str, fraction: f64| TierShare { name: name.into(), fraction };
        config.offload.tiers = Tiers(vec![share(Tiers::RAM, 0.4), share("nvme", 0.6)]);
        let e = check_run(&config, 2, &registry).unwrap_err().to_string();
        assert!(e.starts_with("train.device: cuda:0 cannot run this configuration:\n  - 2 ranks: distributed"), "{e}");
        assert!(e.contains("\n  - offload.tiers: on a GPU run the state streams from one place"), "{e}");
        assert!(!e.contains("hard_limit"), "a GPU run takes memory.hard_limit: {e}");
        // The built-in optimizer and attention kernel take device buffers in a cuda build only.
        let cpu_only = "optimizer 'adamw' runs on the CPU only (its manifest lists devices: cpu)";
        assert_eq!(e.contains(cpu_only), !cfg!(feature = "cuda"), "{e}");

        config.offload.tiers = Tiers::on_device();
        assert!(check_run(&config, 1, &registry).is_ok() == cfg!(feature = "cuda"), "a hard limit alone");

        config.train.device = DeviceSpec::Cpu;
        config.offload.tiers = Tiers(vec![share(Tiers::RAM, 0.4), share("nvme", 0.6)]);
        assert!(check_run(&config, 2, &registry).is_ok(), "the CPU refuses none of it here");
    }

    /// Every `train.master_weights` runs on a GPU, `kahan` included (its compensation lives
    /// and streams with the optimizer state, and the GPU step keeps the CPU's bits): none is
    /// among a GPU run's refusals, with the state on the device or in host memory.
    #[test]
    fn a_gpu_run_takes_every_master_weights_mode() {
        let mut config = Config::default();
        config.train.device = DeviceSpec::Cuda(0);
        config.train.precision = crate::config::Precision::Bf16;
        for mode in [MasterWeights::F32, MasterWeights::None, MasterWeights::Kahan, MasterWeights::Tier] {
            config.train.master_weights = mode;
            for tiers in [Tiers::on_device(), Tiers(vec![TierShare { name: Tiers::RAM.into(), fraction: 1.0 }])] {
                config.offload.tiers = tiers;
                assert!(check_modes(&config, 1).is_ok(), "master_weights: {}", mode.as_str());
            }
        }
    }

    /// A hard limit can make a card smaller, up to its whole memory, never larger: the error
    /// names the key, the card's size and what to set.
    #[test]
    fn a_hard_limit_past_the_card_is_refused_with_the_cards_size() {
        const GIB: u64 = 1 << 30;
        let h100 = 80 * GIB;
        assert!(check_limit(DeviceSpec::Cuda(0), 24 * GIB, h100).is_ok());
        assert!(check_limit(DeviceSpec::Cuda(0), h100, h100).is_ok(), "the whole card");
        let e = check_limit(DeviceSpec::Cuda(1), 96 * GIB, h100).unwrap_err().to_string();
        assert_eq!(
            e,
            "memory.hard_limit: 96GiB is more than the 80.00 GiB of memory cuda:1 has; the limit caps the device \
             memory the run's allocations may hold, so it can make the card smaller, not larger: set \
             memory.hard_limit to at most 81920MiB (or 0 for no limit)"
        );
    }

    /// The GPU's budget default is the card's, capped by the hard limit when one is set.
    #[test]
    fn the_budget_default_is_no_more_than_the_hard_limit() {
        const GIB: u64 = 1 << 30;
        let card = 80 * GIB - card_margin(80 * GIB); // an H100's default: 76 GiB
        assert_eq!(default_budget(card, 0), card, "no limit: the card's");
        assert_eq!(default_budget(card, 24 * GIB), 24 * GIB, "a 24 GiB limit: a 24 GiB card");
        assert_eq!(default_budget(card, 78 * GIB), card, "a limit above the card's budget leaves it");
    }

    /// Without a limit, or on the CPU (where the counting allocator enforces it), no pool.
    #[test]
    fn the_cpu_and_a_run_without_a_limit_cap_nothing_on_a_device() {
        let mut config = Config::default();
        assert!(limit(&candle_core::Device::Cpu, &config).unwrap().is_none());
        config.memory.hard_limit = crate::config::ByteSize(8 << 30);
        assert!(limit(&candle_core::Device::Cpu, &config).unwrap().is_none(), "the CPU's limit is the allocator's");
    }

    #[test]
    fn the_cpu_opens_as_the_cpu() {
        assert!(open(DeviceSpec::Cpu).unwrap().is_cpu());
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_gpu_on_a_build_without_cuda_says_how_to_build_one() {
        let e = open(DeviceSpec::Cuda(1)).unwrap_err().to_string();
        assert!(e.starts_with("train.device: cuda:1: this ava was built without CUDA."), "{e}");
        assert!(e.contains("cargo build --release --features cuda") && e.contains("set train.device: cpu"), "{e}");
    }
}
