//! Where an `Offload` block's input waits between forward and backward
//! ([`BlockDecision::Offload`](ava_core::BlockDecision::Offload), run by `model::recompute`):
//! the one concern of this module and of its `pinned` half (`cuda` feature; uninhabited
//! stand-ins in `park/pinned/absent.rs` without it).
//!
//! Two homes ([`Home`]), chosen once per run by [`Parking::for_run`]:
//!
//! - **Through the offload tier's byte API** ([`Parking::tier`]): on the CPU, whatever the
//!   tier, and on a GPU run whose `plugins.offload` is not the built-in `ram`. Forward reads
//!   the input into host bytes (on a GPU a synchronous device→host copy into pageable memory)
//!   and `put`s them under `activation/block-{i}`; backward `get`s them back into a tensor on
//!   the model's device (on a GPU a copy from pageable memory) and evicts the record; the tier
//!   is told to `prefetch` the next record down while a stage is recomputed. The device copy
//!   goes as soon as the bytes are on the host; the tier's own memory is its peak
//!   ([`Session::peak`], `tier.resident_bytes()` after each put).
//! - **In page-locked host memory** (a GPU run with the built-in `ram` tier): forward writes
//!   the input back on a download copy stream while the next blocks compute, and backward
//!   uploads the next parked input down on an upload copy stream while the current stage is
//!   recomputed. The ordering rules and when device memory is freed are in `park/pinned/cuda.rs`'s
//!   module doc. The ram tier itself stores nothing; its `capacity`, if set, still bounds the
//!   parked bytes. The pinned buffers are kept per block from step to step (page-locking is
//!   slow), so the host holds one buffer per parked block for the whole run: what
//!   [`Session::peak`] reports, and what `ava estimate` lists as host memory.
//!
//! Why only `ram` goes to pinned buffers: `ram` promises exact bytes in host memory, which is
//! what a pinned buffer is, with the copies overlapped. Another tier is chosen for what it
//! does with the bytes (`int8` compresses them 2–4×, `nvme` puts them on disk, a plugin
//! library its own thing), which a pinned buffer would silently drop; so on a GPU such a tier
//! keeps working as on the CPU, through its byte API: correct, but each park and each fetch
//! waits for its copy (the run's header says so). A GPU run that wants the copies hidden
//! selects `ram`.

// The page-locked half; the build chooses its real half or the uninhabited stand-ins inside it.
mod pinned;

use std::sync::Arc;

use ava_core::{DType as StoredType, OffloadTier};
use candle_core::{DType, Device, Result, Tensor};

use crate::memory::home::Home;

/// Where `Offload` blocks' inputs wait for backward, for a whole run (see the module doc).
pub struct Parking {
    /// The run's tier: the home of [`Home::Tier`], and what bounds the page-locked home (the
    /// `ram` tier's capacity).
    tier: Arc<dyn OffloadTier>,
    /// Through the tier, or (a GPU run with the built-in `ram` tier) page-locked buffers and
    /// the copy streams. Never [`Home::Here`]: an input kept where it was computed is not
    /// parked; the match arms take it through the tier like [`Home::Tier`].
    home: Home<(), std::sync::Mutex<pinned::Park>>,
}

impl std::fmt::Debug for Parking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parking").field("pinned", &self.is_pinned()).finish_non_exhaustive()
    }
}

impl Parking {
    /// Inputs parked through `tier`'s byte API.
    pub fn tier(tier: Arc<dyn OffloadTier>) -> Self {
        Self { tier, home: Home::Tier(()) }
    }

    /// The parking of a run on `device` whose tier is `tier`: in page-locked host memory on a
    /// GPU when `builtin_ram` (the selected tier is the built-in `ram`) and `parks` (the plan
    /// offloads a block); through the tier otherwise. The error says why the copy streams
    /// could not be made.
    pub fn for_run(
        tier: Arc<dyn OffloadTier>,
        device: &Device,
        builtin_ram: bool,
        parks: bool,
    ) -> std::result::Result<Self, String> {
        if let (Device::Cuda(gpu), true, true) = (device, builtin_ram, parks) {
            let park = pinned::Park::new(gpu)?;
            return Ok(Self { tier, home: Home::PageLocked(std::sync::Mutex::new(park)) });
        }
        Ok(Self::tier(tier))
    }

    /// Whether inputs go to page-locked host memory (a GPU run with `ram`).
    pub fn is_pinned(&self) -> bool {
        self.home.is_page_locked()
    }

    /// One micro-batch's parking.
    pub(crate) fn session(&self) -> Result<Session<'_>> {
        let home = match &self.home {
            Home::PageLocked(park) => Home::PageLocked(pinned::Session::new(park)?),
            Home::Tier(()) => Home::Tier(()),
            Home::Here => Home::Here,
        };
        Ok(Session { tier: &self.tier, peak: 0, home })
    }
}

/// A parked block input.
pub(crate) enum Parked {
    /// In the tier under this key, with its shape and type.
    Tier { key: String, dims: Vec<usize>, dtype: DType },
    /// In a page-locked buffer (on its way there, or back).
    Pinned(pinned::Parked),
}

/// The parking of one micro-batch: parks in forward, prefetches and takes back in backward.
pub(crate) struct Session<'a> {
    tier: &'a Arc<dyn OffloadTier>,
    /// The most host memory the parked inputs held at once.
    peak: u64,
    /// The parking's home, with the micro-batch's page-locked session in it.
    home: Home<(), pinned::Session<'a>>,
}

impl Session<'_> {
    /// Parks block `block`'s input (B, T, d), computed by the forward just run.
    pub(crate) fn park(&mut self, block: usize, input: Tensor) -> Result<Parked> {
        let _span = crate::profile::scope("forward: park a block's input");
        match &mut self.home {
            Home::PageLocked(pinned) => {
                let parked = pinned.park(block, input, self.tier.as_ref())?;
                self.peak = self.peak.max(pinned.held());
                Ok(Parked::Pinned(parked))
            }
            Home::Tier(()) | Home::Here => {
                let parked = put(self.tier.as_ref(), block, &input)?;
                self.peak = self.peak.max(self.tier.resident_bytes());
                Ok(parked)
            }
        }
    }

    /// Forward is done (the head's forward is queued): the last parked input's device copy
    /// goes once its write-back is (pinned; nothing to do through a tier).
    pub(crate) fn forward_done(&mut self) -> Result<()> {
        match &mut self.home {
            Home::PageLocked(pinned) => pinned.retire(),
            Home::Tier(()) | Home::Here => Ok(()),
        }
    }

    /// Starts bringing `next` back while the stage above it is recomputed: its upload
    /// (pinned), or the tier's prefetch hint.
    pub(crate) fn prefetch(&mut self, next: &mut Parked) -> Result<()> {
        match next {
            Parked::Tier { key, .. } => {
                self.tier.prefetch(key).map_err(|e| candle_core::Error::Msg(format!("offload prefetch {key}: {e}")))
            }
            Parked::Pinned(p) => match &mut self.home {
                Home::PageLocked(pinned) => pinned.upload(p),
                Home::Tier(()) | Home::Here => {
                    candle_core::bail!("a block input parked in page-locked memory without its parking")
                }
            },
        }
    }

    /// The parked input back, on `device` (the model's), ready for the recompute to read.
    pub(crate) fn take(&mut self, parked: Parked, device: &Device) -> Result<Tensor> {
        let _span = crate::profile::scope("backward: bring back a parked input");
        match parked {
            Parked::Tier { key, dims, dtype } => fetch(self.tier.as_ref(), &key, &dims, dtype, device),
            Parked::Pinned(p) => match &mut self.home {
                Home::PageLocked(pinned) => pinned.take(p),
                Home::Tier(()) | Home::Here => {
                    candle_core::bail!("a block input parked in page-locked memory without its parking")
                }
            },
        }
    }

    /// The most host memory the parked inputs held at once, in bytes: the tier's resident
    /// bytes after each put, or the page-locked buffers of the inputs parked at once.
    pub(crate) fn peak(&self) -> u64 {
        self.peak
    }
}

/// Of stages in the order backward pops them from the end, marked `true` where the stage's
/// input is parked: the index of the next parked one backward will take (the last marked),
/// to bring back ahead of it.
pub(crate) fn next_down(parked: &[bool]) -> Option<usize> {
    parked.iter().rposition(|&p| p)
}

/// Puts a block input into the tier, in its own element type.
fn put(tier: &dyn OffloadTier, block: usize, input: &Tensor) -> Result<Parked> {
    let key = format!("activation/block-{block}");
    let dims = input.dims().to_vec();
    let dtype = input.dtype();
    let flat = input.flatten_all()?; // (B·T·d)
    let stored = match dtype {
        DType::F32 => tier.put(&key, bytemuck::cast_slice(&flat.to_vec1::<f32>()?), StoredType::F32),
        DType::BF16 => tier.put(&key, bytemuck::cast_slice(&flat.to_vec1::<half::bf16>()?), StoredType::BF16),
        DType::F16 => tier.put(&key, bytemuck::cast_slice(&flat.to_vec1::<half::f16>()?), StoredType::F16),
        other => candle_core::bail!("offload: block inputs of type {other:?} are not supported"),
    };
    stored.map_err(|e| candle_core::Error::Msg(format!("offload put {key}: {e}")))?;
    Ok(Parked::Tier { key, dims, dtype })
}

/// Takes a block input back from the tier, onto `device`, and evicts its record.
fn fetch(tier: &dyn OffloadTier, key: &str, dims: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    let n: usize = dims.iter().product();
    let get =
        |into: &mut [u8]| tier.get(key, into).map_err(|e| candle_core::Error::Msg(format!("offload get {key}: {e}")));
    let tensor = match dtype {
        DType::F32 => {
            let mut values = vec![0f32; n];
            get(bytemuck::cast_slice_mut(&mut values))?;
            Tensor::from_vec(values, dims, device)?
        }
        DType::BF16 => {
            let mut values = vec![half::bf16::ZERO; n];
            get(bytemuck::cast_slice_mut(&mut values))?;
            Tensor::from_vec(values, dims, device)?
        }
        DType::F16 => {
            let mut values = vec![half::f16::ZERO; n];
            get(bytemuck::cast_slice_mut(&mut values))?;
            Tensor::from_vec(values, dims, device)?
        }
        other => candle_core::bail!("offload: block inputs of type {other:?} are not supported"),
    };
    tier.evict(key).map_err(|e| candle_core::Error::Msg(format!("offload evict {key}: {e}")))?;
    Ok(tensor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_parked_stage_down_is_the_last_one_marked() {
        // Stages [embedding, kept, offload, recompute(held), offload, kept]: backward pops
        // from the end, so the offloaded stage at 4 comes first, then the one at 2.
        let mut parked = vec![false, false, true, false, true, false];
        assert_eq!(next_down(&parked), Some(4));
        parked.truncate(4); // 4 and 5 popped
        assert_eq!(next_down(&parked), Some(2));
        parked.truncate(2);
        assert_eq!(next_down(&parked), None);
        assert_eq!(next_down(&[]), None);
    }

    #[test]
    fn parked_through_the_tier_comes_back_exactly_and_is_evicted() {
        let tier: Arc<dyn OffloadTier> = Arc::new(ava_plugins::builtin::ram::RamTier::new(None));
        let parking = Parking::tier(tier.clone());
        assert!(!parking.is_pinned());
        let mut session = parking.session().unwrap();
        let input = Tensor::arange(0f32, 24.0, &Device::Cpu).unwrap().reshape((2, 3, 4)).unwrap();
        let mut parked = session.park(3, input.clone()).unwrap();
        assert!(matches!(&parked, Parked::Tier { key, .. } if key == "activation/block-3"));
        assert_eq!(session.peak(), 96);
        session.forward_done().unwrap();
        session.prefetch(&mut parked).unwrap();
        let back = session.take(parked, &Device::Cpu).unwrap();
        assert_eq!(back.to_vec3::<f32>().unwrap(), input.to_vec3::<f32>().unwrap());
        assert_eq!(tier.used_bytes(), 0, "evicted after use");
        assert_eq!(session.peak(), 96, "the peak stays");
    }
}
