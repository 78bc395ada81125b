//! Where a run's waiting buffers live ([`Home`]): the optimizer state between steps (with
//! the engine's f32 masters and compensations, which are state buffers of its own) and the
//! inputs of `Offload` blocks between forward and backward.
//!
//! A run chooses each home once, when it is built, from `offload.tiers`, `plugins.offload`
//! and the device; the code that parks, streams or steps matches on the value instead of
//! asking which optional parts are set. The homes away from where the work runs have two
//! forms, each with the moves in and out as its methods:
//!
//! - **a tier** ([`Home::Tier`]): the offload tier's byte API (`put`, `prefetch`, `get`),
//!   on the CPU whatever the tier, and on a GPU with a tier other than the built-in `ram`;
//! - **page-locked host memory streamed through the device** ([`Home::PageLocked`]): a GPU
//!   run with the built-in `ram`, the copies on streams of their own beside compute
//!   (`cuda` feature; without it the page-locked halves are uninhabited stand-ins, so no
//!   value of this variant can exist in a CPU build).
//!
//! [`Home::Here`] is where the work runs: host memory on the CPU, device memory on a GPU.
//!
//! The rules below are the page-locked homes' (how big a parked input's buffer is, which
//! buffer serves which input, how the `ram` tier's capacity bounds them); they are plain
//! arithmetic, here so that both builds compile and test them.

use candle_core::DType;

/// Where a run keeps buffers that wait between uses. `T` is what a tier home holds (the
/// tier and its keys), `P` what a page-locked home holds (its buffers and copy streams).
#[derive(Debug)]
pub enum Home<T, P> {
    /// Where the work runs: host memory on the CPU, device memory on a GPU.
    Here,
    /// An offload tier, through its byte API.
    Tier(T),
    /// Page-locked host memory, streamed through the device (a GPU run with `ram`).
    PageLocked(P),
}

impl<T, P> Home<T, P> {
    /// The tier home's parts, if this is one.
    pub fn tier(&self) -> Option<&T> {
        match self {
            Self::Tier(t) => Some(t),
            _ => None,
        }
    }

    /// The page-locked home's parts, if this is one.
    pub fn page_locked(&self) -> Option<&P> {
        match self {
            Self::PageLocked(p) => Some(p),
            _ => None,
        }
    }

    /// Whether buffers go to page-locked host memory.
    pub fn is_page_locked(&self) -> bool {
        matches!(self, Self::PageLocked(_))
    }
}

/// Bytes of a buffer of shape `dims` in `dtype` (a parked block input's page-locked buffer).
pub fn bytes_of(dims: &[usize], dtype: DType) -> usize {
    dims.iter().product::<usize>() * dtype.size_in_bytes()
}

/// The page-locked buffer kept for a block, `have` bytes (None: none yet), serves an input
/// of `need` bytes: one as large or larger (a micro-batch halved by a back-off uses its
/// start); a smaller one is replaced.
pub fn reusable(have: Option<usize>, need: usize) -> bool {
    have.is_some_and(|have| have >= need)
}

/// Whether `more` bytes may be parked with `parked` already parked under the tier's
/// `capacity` less what it `used` itself; the error says how much is in use.
pub fn room_for(capacity: u64, used: u64, parked: u64, more: u64) -> Result<(), String> {
    let free = capacity.saturating_sub(used);
    if parked.saturating_add(more) > free {
        return Err(format!(
            "{} of the ram tier's capacity of {} in use ({} by block inputs parked in page-locked host memory)",
            ava_core::format_size(used + parked),
            ava_core::format_size(capacity),
            ava_core::format_size(parked)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_home_is_one_place() {
        let tier: Home<&str, u8> = Home::Tier("nvme");
        assert_eq!(tier.tier(), Some(&"nvme"));
        assert_eq!(tier.page_locked(), None);
        assert!(!tier.is_page_locked());
        let pinned: Home<&str, u8> = Home::PageLocked(7);
        assert_eq!((pinned.tier(), pinned.page_locked()), (None, Some(&7)));
        assert!(pinned.is_page_locked());
        let here: Home<&str, u8> = Home::Here;
        assert_eq!((here.tier(), here.page_locked(), here.is_page_locked()), (None, None, false));
    }

    #[test]
    fn a_buffer_is_its_elements_in_its_type() {
        assert_eq!(bytes_of(&[2, 16, 32], DType::F32), 2 * 16 * 32 * 4);
        assert_eq!(bytes_of(&[2, 16, 32], DType::BF16), 2 * 16 * 32 * 2);
        assert_eq!(bytes_of(&[1, 1, 1], DType::F16), 2);
    }

    #[test]
    fn a_block_buffer_serves_inputs_no_larger() {
        assert!(!reusable(None, 8));
        assert!(reusable(Some(8), 8));
        assert!(reusable(Some(16), 8), "a halved micro-batch uses the start of its buffer");
        assert!(!reusable(Some(8), 16), "a larger input needs a larger buffer");
    }

    #[test]
    fn the_ram_tiers_capacity_bounds_the_parked_bytes() {
        assert_eq!(room_for(u64::MAX, 0, 1 << 40, 1 << 40), Ok(()));
        assert_eq!(room_for(100, 0, 60, 40), Ok(()));
        let err = room_for(100, 10, 60, 40).unwrap_err();
        assert!(err.contains("70 B of the ram tier's capacity of 100 B in use (60 B by block inputs"), "{err}");
    }
}
