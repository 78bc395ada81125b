//! Stage 2's reduction during backward: a [`GradSink`] that reduce-scatters each stretch's
//! gradients as soon as backward has finished them, while backward goes on below.
//!
//! Backward hands over gradients stretch by stretch (`model::forward_backward`), and this
//! sink asks for a stretch per block, kept blocks included. After each stretch the sink moves the now-final gradients into the current bucket; a bucket of
//! `distributed.bucket_size` bytes is started as a reduce-scatter
//! ([`Collectives::start_reduce_scatter`]: over MPI it runs on a communication thread while
//! this one computes the next stretch) and the gradients it copied are freed. Each rank
//! keeps only its own parameters' sums, averaged and accumulated over the micro-batches, so
//! gradients of other ranks' parameters never outlive their stretch by more than the
//! buckets in flight (at most [`IN_FLIGHT`]: more waits for the oldest). Every micro-batch is
//! reduced (as ZeRO-2 does): accumulating locally first would hold whole-model gradients
//! through the accumulation, which is what stage 2 is for not holding.
//!
//! Every rank builds the same buckets in the same order: the order comes from the plan,
//! which all ranks share. A parameter a rank has no gradient for (an expert its tokens did
//! not reach) travels as zeros, and each parameter carries one more value, 1 where the rank
//! had a gradient: the owner learns whether any rank had one, and a parameter none had stays
//! without a gradient, as on one process.

use std::collections::VecDeque;
use std::time::Instant;

use candle_core::{Device, Tensor};

use super::{Pending, Zero};
use crate::model::{GradSink, Grads, Param};
use crate::train::TrainError;

/// Buckets whose reduce-scatter may run at once; starting another waits for the oldest.
pub const IN_FLIGHT: usize = 2;

/// Time a step's reduction took, and how much of it the caller waited for.
#[derive(Debug, Default, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CommTimes {
    /// Seconds the reduce-scatters ran (summed over buckets; waiting for a late rank counts).
    pub seconds: f64,
    /// Seconds the training thread was held up by them: what did not overlap backward.
    pub exposed_seconds: f64,
    /// ZeRO stage 3: seconds the training thread spent gathering weights from the other
    /// ranks (the all-gathers block, so all of it is exposed).
    #[serde(default, skip_serializing_if = "crate::train::is_zero")]
    pub gather_seconds: f64,
}

impl CommTimes {
    /// The fraction of the communication hidden behind compute, 0..1.
    pub fn overlap(&self) -> f64 {
        if self.seconds <= 0.0 { 0.0 } else { (1.0 - self.exposed_seconds / self.seconds).clamp(0.0, 1.0) }
    }
}

/// A bucket under way: its parameters in the buffer's order, and the collective.
struct InFlight {
    params: Vec<usize>,
    pending: Pending,
}

/// Stage 2's sink: see the module documentation.
pub struct ReduceInBackward<'a> {
    zero: &'a Zero,
    params: &'a [Param],
    /// This rank's own parameters' gradients: summed over the ranks, divided by their
    /// number, added over the micro-batches. Other parameters' entries stay `None`.
    acc: Grads,
    /// The micro-batch's gradients not yet in a bucket (a tied embedding's two uses summed).
    local: Grads,
    /// The micro-batch's order of final gradients, and how much of it is in buckets.
    order: Vec<usize>,
    handed: usize,
    /// The bucket being filled, and its bytes.
    bucket: Vec<usize>,
    bucket_bytes: usize,
    in_flight: VecDeque<InFlight>,
    times: CommTimes,
    /// The error behind a failed call (candle's error type carries only its text).
    failure: Option<TrainError>,
}

impl<'a> ReduceInBackward<'a> {
    /// A sink for one step's micro-batches.
    pub fn new(zero: &'a Zero, params: &'a [Param]) -> Self {
        Self {
            zero,
            params,
            acc: vec![None; params.len()],
            local: vec![None; params.len()],
            order: Vec::new(),
            handed: 0,
            bucket: Vec::new(),
            bucket_bytes: 0,
            in_flight: VecDeque::new(),
            times: CommTimes::default(),
            failure: None,
        }
    }

    /// Waits for the buckets still in flight: this rank's reduced gradients and the times.
    pub fn finish(mut self) -> Result<(Grads, CommTimes), TrainError> {
        if !self.bucket.is_empty() {
            self.start_bucket()?;
        }
        while !self.in_flight.is_empty() {
            self.complete_oldest()?;
        }
        Ok((self.acc, self.times))
    }

    /// The error behind the last failed call, if it was this sink's.
    pub fn take_failure(&mut self) -> Option<TrainError> {
        self.failure.take()
    }

    fn numel(&self, i: usize) -> usize {
        self.params[i].def.numel()
    }

    /// Starts the reduce-scatter of the current bucket. The buffer is laid out by owner
    /// (range r is rank r's parameters), each parameter followed by its presence flag.
    fn start_bucket(&mut self) -> Result<(), TrainError> {
        if self.in_flight.len() >= IN_FLIGHT {
            self.complete_oldest()?;
        }
        let mut params = std::mem::take(&mut self.bucket);
        self.bucket_bytes = 0;
        params.sort_by_key(|&i| self.zero.owner(i)); // stable: backward order within a rank
        let mut counts = vec![0; self.zero.size()];
        let len: usize = params.iter().map(|&i| self.numel(i) + 1).sum();
        let mut flat = Vec::with_capacity(len); // (Σ numel + 1,) f32
        for &i in &params {
            counts[self.zero.owner(i)] += self.numel(i) + 1;
            match self.local[i].take() {
                Some(g) => {
                    flat.extend(g.flatten_all().and_then(|g| g.to_vec1::<f32>()).map_err(TrainError::candle)?);
                    flat.push(1.0);
                }
                None => flat.resize(flat.len() + self.numel(i) + 1, 0.0),
            }
        }
        let started = Instant::now();
        let pending = self.zero.group().start_reduce_scatter(flat, counts)?;
        self.times.exposed_seconds += started.elapsed().as_secs_f64();
        self.in_flight.push_back(InFlight { params, pending });
        Ok(())
    }

    /// Waits for the oldest bucket and adds this rank's share of it to the accumulators.
    fn complete_oldest(&mut self) -> Result<(), TrainError> {
        let Some(InFlight { params, pending }) = self.in_flight.pop_front() else { return Ok(()) };
        let waiting = Instant::now();
        let (flat, ran) = pending.wait()?;
        self.times.exposed_seconds += waiting.elapsed().as_secs_f64();
        self.times.seconds += ran.as_secs_f64();
        let scale = 1.0 / self.zero.size() as f32;
        let mut at = 0;
        for i in params {
            let n = self.numel(i);
            // Only the owner's range holds sums; the flag says whether any rank had a gradient.
            if self.zero.owner(i) == self.zero.rank() && flat[at + n] > 0.0 {
                let values: Vec<f32> = flat[at..at + n].iter().map(|v| v * scale).collect();
                let g = Tensor::from_vec(values, self.params[i].def.shape.as_slice(), &Device::Cpu);
                let g = g.map_err(TrainError::candle)?;
                self.acc[i] = Some(match self.acc[i].take() {
                    Some(acc) => (acc + g).map_err(TrainError::candle)?,
                    None => g,
                });
            }
            at += n + 1;
        }
        Ok(())
    }

    /// Runs `f`, keeping its error for [`ReduceInBackward::take_failure`] and handing candle
    /// its text.
    fn keep_failure(&mut self, f: impl FnOnce(&mut Self) -> Result<(), TrainError>) -> candle_core::Result<()> {
        f(self).map_err(|e| {
            let text = e.to_string();
            self.failure = Some(e);
            candle_core::Error::Msg(text)
        })
    }
}

impl GradSink for ReduceInBackward<'_> {
    fn expect(&mut self, order: &[usize]) -> candle_core::Result<()> {
        self.order = order.to_vec();
        self.handed = 0;
        Ok(())
    }

    fn receive(&mut self, i: usize, g: Tensor, _last: bool) -> candle_core::Result<()> {
        // A tied embedding's head use waits here for its embedding use.
        self.local[i] = Some(match self.local[i].take() {
            Some(acc) => (acc + g)?,
            None => g,
        });
        Ok(())
    }

    fn block_stretches(&self) -> bool {
        true // a bucket can start as soon as a block's backward ends
    }

    fn stretch_done(&mut self, final_count: usize) -> candle_core::Result<()> {
        self.keep_failure(|s| {
            while s.handed < final_count {
                let i = s.order[s.handed];
                s.handed += 1;
                s.bucket.push(i);
                s.bucket_bytes += (s.numel(i) + 1) * 4;
                if s.bucket_bytes >= s.zero.bucket_bytes() {
                    s.start_bucket()?;
                }
            }
            // The micro-batch's last stretch: what is left goes now, not with the next one's,
            // and every bucket lands before the next micro-batch: their copies would
            // otherwise stay through its forward, where activations peak (the estimator's
            // replay drains them here too).
            if final_count == s.order.len() {
                if !s.bucket.is_empty() {
                    s.start_bucket()?;
                }
                while !s.in_flight.is_empty() {
                    s.complete_oldest()?;
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_is_the_hidden_fraction_of_the_communication() {
        let t = CommTimes { seconds: 2.0, exposed_seconds: 0.5, ..Default::default() };
        assert!((t.overlap() - 0.75).abs() < 1e-12);
        assert_eq!(CommTimes { seconds: 1.0, exposed_seconds: 3.0, ..Default::default() }.overlap(), 0.0);
        assert_eq!(CommTimes::default().overlap(), 0.0);
    }
}
