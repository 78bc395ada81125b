//! ZeRO's partitioning (Rajbhandari et al., 2020) as the engine runs it: which rank owns
//! each parameter, and the collectives of each stage.
//!
//! The state is split by **whole parameters**, in model order: rank r owns a contiguous
//! run of parameters whose optimizer-state bytes come nearest to r/N..(r+1)/N of the total.
//! Whole parameters because the non-elementwise optimizers need the whole tensor (8-bit
//! Adam's blocks, Adafactor's row and column factors, Adam-mini's per-head means), and the
//! contract hands a plugin whole parameters; the cost is a split that can be off by up to
//! one parameter from an even one.
//!
//! - Stage 0: gradients are all-reduced; every rank steps every parameter.
//! - Stage 1: gradients are all-reduced; each rank steps (and holds the state of) its own
//!   parameters, then the updated parameters are all-gathered.
//! - Stage 2: gradients are reduce-scattered during backward, stretch by stretch
//!   ([`super::ReduceInBackward`]): each rank keeps only its own parameters' (summed)
//!   gradients; then as stage 1.
//! - Stage 3: as stage 2, and each rank holds only its own parameters' values: a block's
//!   weights are all-gathered before its forward and again before its backward, and let
//!   go after each ([`super::Gathered`]); nothing is gathered after the step.
//!
//! Gradients are averaged (each rank's loss is the mean over its own tokens, so the mean of
//! the ranks' gradients is the gradient of the mean over all of them), in buckets of about
//! `distributed.bucket_size` bytes.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::Collectives;
use crate::model::Param;
use crate::train::TrainError;

/// Owner of each parameter: contiguous runs in model order, rank r's run ending at the
/// parameter boundary nearest to (r + 1)/N of the total `bytes`.
pub fn owners(bytes: &[u64], world: usize) -> Vec<usize> {
    let total: u64 = bytes.iter().sum();
    let world = world.max(1) as u64;
    let mut before = 0u64;
    bytes
        .iter()
        .map(|&b| {
            // The rank whose share holds this parameter's midpoint.
            let mid = 2 * before + b; // twice the midpoint, to stay in integers
            before += b;
            if total == 0 { 0 } else { ((mid * world) / (2 * total)).min(world - 1) as usize }
        })
        .collect()
}

/// A run's ZeRO layout and its collectives.
pub struct Zero {
    group: Arc<dyn Collectives>,
    stage: u8,
    owner: Vec<usize>,
    /// Bytes per bucket.
    bucket: usize,
}

impl std::fmt::Debug for Zero {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Zero").field("stage", &self.stage).field("rank", &self.rank()).finish_non_exhaustive()
    }
}

impl Zero {
    /// The layout of parameters whose optimizer state takes `state_bytes` each.
    pub fn new(group: Arc<dyn Collectives>, stage: u8, state_bytes: &[u64], bucket_bytes: u64) -> Self {
        let owner = owners(state_bytes, group.size());
        Self { group, stage, owner, bucket: bucket_bytes.clamp(4096, 1 << 30) as usize }
    }

    /// The collectives.
    pub fn group(&self) -> &dyn Collectives {
        self.group.as_ref()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// The ZeRO stage.
    pub fn stage(&self) -> u8 {
        self.stage
    }

    /// Whether this is rank 0 (which prints and writes).
    pub fn is_root(&self) -> bool {
        self.rank() == 0
    }

    /// The rank that steps parameter `i` (from stage 1 the only one holding its state).
    pub fn owner(&self, i: usize) -> usize {
        self.owner[i]
    }

    /// Bytes per bucket of gradients or parameters.
    pub fn bucket_bytes(&self) -> usize {
        self.bucket
    }

    /// Whether this rank steps parameter `i` and holds its optimizer state.
    pub fn steps(&self, i: usize) -> bool {
        self.stage == 0 || self.owner[i] == self.rank()
    }

    /// Consecutive parameter ranges of about `bucket` bytes (`size(i)` bytes each; a
    /// parameter larger than a bucket travels alone).
    fn buckets(&self, n: usize, size: impl Fn(usize) -> usize) -> Vec<std::ops::Range<usize>> {
        let mut out = Vec::new();
        let (mut start, mut bytes) = (0, 0);
        for i in 0..n {
            if i > start && bytes + size(i) > self.bucket {
                out.push(start..i);
                (start, bytes) = (i, 0);
            }
            bytes += size(i);
        }
        if start < n {
            out.push(start..n);
        }
        out
    }

    /// Stages 0 and 1, after backward: sums the ranks' gradients and divides by the number
    /// of ranks, leaving every gradient on every rank (stage 2 reduces during backward:
    /// [`super::ReduceInBackward`]). A gradient a rank lacks (an expert its tokens did not
    /// reach) counts as zeros; after the reduction every parameter some rank had a gradient
    /// for has one.
    pub fn reduce_gradients(&self, params: &[Param], grads: &mut [Option<Tensor>]) -> Result<(), TrainError> {
        if self.size() == 1 {
            return Ok(()); // nothing to add, nothing to copy
        }
        let numel = |i: usize| params[i].def.numel();
        // Whether any rank has a gradient for each parameter (so all agree on which exist).
        let mut present: Vec<u64> = grads.iter().map(|g| g.is_some() as u64).collect();
        self.group.all_reduce_max(&mut present)?;
        let scale = 1.0 / self.size() as f32;
        for range in self.buckets(params.len(), |i| numel(i) * 4) {
            let mut flat: Vec<f32> = Vec::with_capacity(range.clone().map(numel).sum()); // (bucket,) f32
            for i in range.clone() {
                match grads[i].take() {
                    Some(g) => {
                        flat.extend(g.flatten_all().and_then(|g| g.to_vec1::<f32>()).map_err(TrainError::candle)?)
                    }
                    None => flat.resize(flat.len() + numel(i), 0.0),
                }
            }
            self.group.all_reduce_sum(&mut flat)?;
            let mut at = 0;
            for i in range {
                let len = numel(i);
                if present[i] > 0 {
                    let values: Vec<f32> = flat[at..at + len].iter().map(|v| v * scale).collect();
                    let t = Tensor::from_vec(values, params[i].def.shape.as_slice(), &Device::Cpu);
                    grads[i] = Some(t.map_err(TrainError::candle)?);
                }
                at += len;
            }
        }
        Ok(())
    }

    /// After each rank stepped its own parameters (stages 1 and 2): every rank gets every
    /// updated parameter, in its stored type, bit for bit. Stage 3 keeps only its own, and
    /// gathers the others block by block when it needs them ([`super::Gathered`]).
    pub fn gather_parameters(&self, params: &[Param]) -> Result<(), TrainError> {
        if self.stage == 0 || self.stage >= 3 || self.size() == 1 {
            return Ok(());
        }
        let bytes_of = |i: usize| params[i].stored_bytes();
        for range in self.buckets(params.len(), bytes_of) {
            let ids: Vec<usize> = range.collect();
            // Each parameter is set as it is read out of the bucket: one copy beside it.
            self.gather_into(params, &ids, &mut |i, t| {
                if self.owner[i] != self.rank() {
                    params[i].var.set(&t).map_err(TrainError::candle)?;
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Parameters `ids` (ascending) as their owners hold them, in their stored type: one
    /// all-gather of their bytes. A rank's own parameters come back as its own tensors.
    pub fn gather_some(&self, params: &[Param], ids: &[usize]) -> Result<Vec<Tensor>, TrainError> {
        let mut out = Vec::with_capacity(ids.len());
        self.gather_into(params, ids, &mut |_, t| {
            out.push(t);
            Ok(())
        })?;
        Ok(out)
    }

    /// One all-gather of parameters `ids` (ascending, so the byte ranges follow the ranks),
    /// each handed to `take` as it is read out of the gathered bytes.
    fn gather_into(
        &self,
        params: &[Param],
        ids: &[usize],
        take: &mut dyn FnMut(usize, Tensor) -> Result<(), TrainError>,
    ) -> Result<(), TrainError> {
        debug_assert!(ids.windows(2).all(|w| w[0] < w[1]), "ascending, so the ranges follow the ranks");
        let bytes_of = |i: usize| params[i].stored_bytes();
        let me = self.rank();
        // Every rank takes part, even one that holds them all (the others need them).
        if self.size() == 1 {
            return ids.iter().try_for_each(|&i| take(i, params[i].var.as_tensor().clone()));
        }
        let mut flat = Vec::with_capacity(ids.iter().map(|&i| bytes_of(i)).sum()); // (Σ bytes,) u8
        let mut counts = vec![0; self.size()];
        for &i in ids {
            if self.owner[i] == me {
                flat.extend(tensor_bytes(params[i].var.as_tensor())?);
            } else {
                flat.resize(flat.len() + bytes_of(i), 0);
            }
            counts[self.owner[i]] += bytes_of(i);
        }
        self.group.all_gather(&mut flat, &counts)?;
        let mut at = 0;
        for &i in ids {
            let (p, len) = (&params[i], bytes_of(i));
            let t = if self.owner[i] == me {
                p.var.as_tensor().clone()
            } else {
                Tensor::from_raw_buffer(&flat[at..at + len], p.var.dtype(), &p.def.shape, &Device::Cpu)
                    .map_err(TrainError::candle)?
            };
            take(i, t)?;
            at += len;
        }
        Ok(())
    }

    /// Whether this rank holds parameter `i`'s values between steps (all of them, except
    /// at stage 3, where only its own).
    pub fn holds_values(&self, i: usize) -> bool {
        self.stage < 3 || self.size() == 1 || self.owner[i] == self.rank()
    }

    /// Agreement on flags: the maximum of each over the ranks.
    pub fn agree(&self, flags: &mut [u64]) -> Result<(), TrainError> {
        self.group.all_reduce_max(flags).map_err(TrainError::from)
    }

    /// The mean over the ranks of each value.
    pub fn mean(&self, values: &mut [f64]) -> Result<(), TrainError> {
        self.group.all_reduce_sum_f64(values)?;
        let n = self.size() as f64;
        values.iter_mut().for_each(|v| *v /= n);
        Ok(())
    }

    /// The sum over the ranks of each value.
    pub fn sum(&self, values: &mut [f64]) -> Result<(), TrainError> {
        self.group.all_reduce_sum_f64(values).map_err(TrainError::from)
    }

    /// Every rank's `value`, by rank.
    pub fn gather_each(&self, value: u64) -> Result<Vec<u64>, TrainError> {
        let mut bytes = vec![0u8; 8 * self.size()]; // (ranks,) u64
        let me = self.rank();
        bytes[8 * me..8 * me + 8].copy_from_slice(&value.to_le_bytes());
        self.group.all_gather(&mut bytes, &vec![8; self.size()])?;
        Ok(bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
    }

    /// `bytes` from `root` (a buffer of the right length on every rank).
    pub fn broadcast(&self, bytes: &mut [u8], root: usize) -> Result<(), TrainError> {
        self.group.broadcast(bytes, root).map_err(TrainError::from)
    }
}

/// A tensor's values as little-endian bytes in its own type.
fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>, TrainError> {
    let t = t.flatten_all().map_err(TrainError::candle)?;
    let bytes = match t.dtype() {
        DType::F32 => bytemuck::cast_slice(&t.to_vec1::<f32>().map_err(TrainError::candle)?).to_vec(),
        DType::BF16 => bytemuck::cast_slice(&t.to_vec1::<half::bf16>().map_err(TrainError::candle)?).to_vec(),
        DType::F16 => bytemuck::cast_slice(&t.to_vec1::<half::f16>().map_err(TrainError::candle)?).to_vec(),
        DType::F64 => bytemuck::cast_slice(&t.to_vec1::<f64>().map_err(TrainError::candle)?).to_vec(),
        dt => return Err(TrainError::Invalid(format!("parameters of type {dt:?} cannot be gathered"))),
    };
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_split_whole_parameters_nearest_to_even_shares() {
        assert_eq!(owners(&[10, 10, 10, 10], 2), vec![0, 0, 1, 1]);
        assert_eq!(owners(&[10, 10, 10, 10], 1), vec![0; 4]);
        // A large parameter goes to the rank its midpoint falls in (51 of 103: rank 0).
        assert_eq!(owners(&[1, 100, 1, 1], 2), vec![0, 0, 1, 1]);
        assert_eq!(owners(&[1, 1, 100, 1], 2), vec![0, 0, 1, 1]);
        assert_eq!(owners(&[5, 5, 5], 3), vec![0, 1, 2]);
        // More ranks than parameters: some own nothing.
        assert_eq!(owners(&[5, 5], 4), vec![1, 3]);
        assert_eq!(owners(&[0, 0], 2), vec![0, 0]);
        // Each rank's share is within one parameter of even.
        let bytes: Vec<u64> = (0..37).map(|i| 100 + (i * 37 % 11) * 40).collect();
        let total: u64 = bytes.iter().sum();
        let largest = *bytes.iter().max().unwrap();
        for world in 2..6 {
            let o = owners(&bytes, world);
            assert!(o.windows(2).all(|w| w[0] <= w[1]), "contiguous runs");
            for r in 0..world {
                let mine: u64 = bytes.iter().zip(&o).filter(|(_, w)| **w == r).map(|(b, _)| b).sum();
                assert!(mine.abs_diff(total / world as u64) <= largest, "world {world} rank {r}: {mine}");
            }
        }
    }
}
