//! ZeRO stage 3's weights: each rank holds only its own parameters, and the forward pass
//! gets the others' block by block. [`forward_backward`](crate::model::forward_backward)
//! fetches a block's parameters before its forward, releases them after it when the block
//! is recomputed, fetches them again before its backward and releases them after; a kept
//! block's weights stay in its graph until its backward (as its activations do), so with
//! no checkpointing a rank holds every block's weights at the end of forward, and with full
//! checkpointing only the embedding, the head and one block's (two while a stretch's
//! gradients leave).
//!
//! A fetch is one all-gather of the missing parameters' bytes in their stored type (every
//! rank fetches the same parameters in the same order, since all run the same plan). A
//! gathered copy becomes a fresh `Var`, so backward gives its gradient, which the stage's
//! sink reduce-scatters to the owner ([`super::ReduceInBackward`]) like any other.

use std::rc::Rc;

use candle_core::{DType, Result, Tensor, Var};

use super::Zero;
use crate::model::fused::cast;
use crate::model::{Model, Weights};

/// The weights of one step (or one evaluation) at stage 3: see the module documentation.
pub struct Gathered {
    zero: Rc<Zero>,
    /// The type the forward pass computes in.
    compute: DType,
    /// For evaluation: plain tensors, no graph.
    detached: bool,
    /// By parameter: the `Var` a gathered copy was made into (`None` for this rank's own
    /// parameters, whose leaf is the model's `Var`, and for ones not fetched).
    leaves: Vec<Option<Var>>,
    /// By parameter: the weight as the forward pass uses it, or `empty` when not fetched.
    tensors: Vec<Tensor>,
    present: Vec<bool>,
    empty: Tensor,
    /// Time spent in the all-gathers.
    waited: std::time::Duration,
}

impl Gathered {
    /// Nothing fetched yet; `detached` for a forward pass without backward.
    pub fn new(zero: Rc<Zero>, model: &Model, compute: DType, detached: bool) -> Result<Self> {
        let n = model.params().len();
        let empty = Tensor::zeros(0, compute, &candle_core::Device::Cpu)?;
        Ok(Self {
            zero,
            compute,
            detached,
            leaves: vec![None; n],
            tensors: vec![empty.clone(); n],
            present: vec![false; n],
            empty,
            waited: std::time::Duration::ZERO,
        })
    }
}

impl Weights for Gathered {
    fn fetch(&mut self, model: &Model, params: &[usize]) -> Result<()> {
        let mut missing: Vec<usize> = params.iter().copied().filter(|&i| !self.present[i]).collect();
        missing.sort_unstable();
        missing.dedup();
        if missing.is_empty() {
            return Ok(());
        }
        let _span = crate::profile::scope("zero-3: all-gather weights");
        let started = std::time::Instant::now();
        let values = self
            .zero
            .gather_some(model.params(), &missing)
            .map_err(|e| candle_core::Error::Msg(format!("gathering parameters from their ranks: {e}")))?;
        self.waited += started.elapsed();
        for (i, t) in missing.into_iter().zip(values) {
            let own = self.zero.owner(i) == self.zero.rank();
            let leaf = if own || self.detached {
                t
            } else {
                let var = Var::from_tensor(&t)?;
                let leaf = var.as_tensor().clone();
                self.leaves[i] = Some(var);
                leaf
            };
            let leaf = if self.detached { leaf.detach() } else { leaf };
            self.tensors[i] = cast(&leaf, self.compute)?;
            self.present[i] = true;
        }
        Ok(())
    }

    fn release(&mut self, params: &[usize]) {
        for &i in params {
            if !std::mem::replace(&mut self.present[i], false) {
                continue;
            }
            self.leaves[i] = None;
            self.tensors[i] = self.empty.clone();
        }
    }

    fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    fn gather_seconds(&self) -> f64 {
        self.waited.as_secs_f64()
    }

    fn leaf(&self, model: &Model, i: usize) -> Tensor {
        match &self.leaves[i] {
            Some(var) => var.as_tensor().clone(),
            None if self.zero.owner(i) == self.zero.rank() => model.params()[i].var.as_tensor().clone(),
            None => self.empty.clone(),
        }
    }
}
