//! The optimizer step inside backward (`train.step_in_backward`; LOMO, torchtune's
//! `optimizer_in_bwd`): a [`GradSink`] that steps each parameter as soon as backward has
//! its final gradient and drops the gradient at once, so the whole-model gradient buffer
//! never exists. With the state in a tier, the session reads the state of the parameters
//! backward reaches next while the current stretch's backward runs (ZeRO-Infinity's
//! overlap, which needs exactly this: the step of a block's parameters before the backward
//! of the block below).

use ava_core::{Optimizer, StepContext};
use candle_core::Tensor;

use super::TrainError;
use super::optim::{OptimizerState, StepSession, step_param};
use super::rounding;
use crate::model::fused::DeferredSums;
use crate::model::{GradSink, Param, ParamRole};

/// The weight decay a parameter of `role` gets: matrices only.
pub(crate) fn decay_for(role: ParamRole, weight_decay: f64) -> f64 {
    match role {
        ParamRole::Matrix | ParamRole::ResidualOut => weight_decay,
        ParamRole::Embedding | ParamRole::Norm | ParamRole::Bias => 0.0,
    }
}

/// What a step's parameters are stepped with.
pub(crate) struct StepSettings<'a> {
    pub optimizer: &'a mut dyn Optimizer,
    /// The optimizer's name, for errors.
    pub plugin: &'a str,
    pub params: &'a [Param],
    pub step: u64,
    pub lr: f64,
    pub weight_decay: f64,
    pub threads: u32,
    /// The run's seed (stochastic rounding).
    pub seed: u64,
    /// The factor the gradients handed to [`apply`](Self::apply) still need (clipping over
    /// the loss scale), for an optimizer that applies it itself; 1 otherwise.
    pub grad_scale: f64,
}

impl StepSettings<'_> {
    /// Steps parameter `i` from `grad` (f32, times `grad_scale`, which the optimizer
    /// applies); returns the gradient's Σ g² on the CPU (see [`step_param`]).
    pub(crate) fn apply(
        &mut self,
        i: usize,
        grad: &Tensor,
        buffers: &mut Vec<super::StateBuffer>,
    ) -> Result<Option<f64>, TrainError> {
        let param = &self.params[i];
        let ctx = StepContext {
            step: self.step,
            lr: self.lr,
            weight_decay: decay_for(param.def.role, self.weight_decay),
            threads: self.threads,
            grad_scale: self.grad_scale,
        };
        let seed = rounding::seed_for(self.seed, self.step, i);
        step_param(self.optimizer, self.plugin, param, grad, buffers, ctx, seed)
    }
}

/// Steps parameters as their gradients arrive.
pub(crate) struct StepInBackward<'a> {
    settings: StepSettings<'a>,
    /// The state, until backward says its order and the session starts.
    state: Option<&'a mut OptimizerState>,
    session: Option<StepSession<'a>>,
    /// A tied embedding's head gradient, waiting for its embedding use.
    pending: Vec<Option<Tensor>>,
    /// Σ g² over the final gradients stepped on the CPU (the norm is logged; it cannot clip:
    /// see the config).
    sumsq: f64,
    /// The GPU's gradients' Σ g², queued as they are stepped.
    on_device: DeferredSums,
    /// The first error, kept whole (the sink's own error type is candle's).
    pub failure: Option<TrainError>,
    /// Test hook: the second gradient to arrive is made NaN.
    poison: bool,
    /// Gradients stepped so far.
    stepped: usize,
}

impl<'a> StepInBackward<'a> {
    pub(crate) fn new(settings: StepSettings<'a>, state: &'a mut OptimizerState, poison: bool) -> Self {
        let n = settings.params.len();
        Self {
            settings,
            state: Some(state),
            session: None,
            pending: vec![None; n],
            sumsq: 0.0,
            on_device: DeferredSums::new(n),
            failure: None,
            poison,
            stepped: 0,
        }
    }

    /// Ends the step: waits for the tier's writes, reads the GPU's sums of squares (one
    /// read) and checks them. Returns the tier's numbers and Σ g² over every gradient
    /// stepped. Of several failures the first inside backward wins, then a gradient that was
    /// not finite (the likelier cause of what followed it), then the tier's own error.
    pub(crate) fn finish(self) -> Result<(super::StreamStats, f64), TrainError> {
        if let Some(e) = self.failure {
            return Err(e);
        }
        let stream = match self.session {
            Some(s) => s.finish(),
            None => Ok(super::StreamStats::default()),
        };
        let mut sumsq = self.sumsq;
        let sums = self.on_device.read().map_err(|e| {
            TrainError::Candle(format!(
                "reading the gradients' sums of squares at the end of backward (an earlier kernel of this step, \
                 an optimizer's step_cuda included, may have failed): {e}"
            ))
        })?;
        for (i, s) in sums {
            sumsq += check_finite(&self.settings, i, f64::from(s))?;
        }
        Ok((stream?, sumsq))
    }

    fn fail(&mut self, e: TrainError) -> candle_core::Error {
        let message = e.to_string();
        self.failure.get_or_insert(e);
        candle_core::Error::Msg(format!("optimizer step inside backward: {message}"))
    }

    /// Steps parameter `i`. Its Σ g² is checked after the step: on the CPU the step's own sum
    /// (it reads each gradient once), on a GPU a sum queued on the device and read with all
    /// the others when backward ends, so no parameter waits for the device. A gradient that is
    /// not finite has then been stepped into its parameter (and on a GPU, every later one as
    /// well): the step fails and nothing of it is saved, as for any failure inside backward.
    fn step(&mut self, i: usize, grad: Tensor) -> Result<(), TrainError> {
        let grad = if self.poison && self.stepped == 1 {
            grad.affine(f64::NAN, 0.0).map_err(TrainError::candle)?
        } else {
            grad
        };
        self.stepped += 1;
        let queued = self.on_device.push(i, &grad).map_err(TrainError::candle)?;
        let session = self.session.as_mut().ok_or_else(|| {
            TrainError::Invalid("step in backward: a gradient arrived before backward announced its order".into())
        })?;
        let settings = &mut self.settings;
        let mut summed = None;
        session.step(i, &mut |i, buffers| {
            summed = settings.apply(i, &grad, buffers)?;
            Ok(())
        })?;
        if !queued {
            let s = summed.ok_or_else(|| TrainError::Invalid("step in backward: a CPU step gave no Σ g²".into()))?;
            self.sumsq += check_finite(&self.settings, i, s)?;
        }
        Ok(())
    }
}

/// `sumsq`, parameter `i`'s Σ g², if it is finite; else the error naming the parameter.
fn check_finite(settings: &StepSettings<'_>, i: usize, sumsq: f64) -> Result<f64, TrainError> {
    if sumsq.is_finite() {
        return Ok(sumsq);
    }
    let name = &settings.params[i].def.name;
    let word = if sumsq.is_nan() { "NaN" } else { "infinite" };
    Err(TrainError::NonFiniteInBackward { step: settings.step, what: format!("the gradient of {name} is {word}") })
}

impl GradSink for StepInBackward<'_> {
    fn expect(&mut self, order: &[usize]) -> candle_core::Result<()> {
        let Some(state) = self.state.take() else {
            return Err(self.fail(TrainError::Invalid(
                "step in backward handles one micro-batch per step (gradient_accumulation_steps: 1)".into(),
            )));
        };
        match state.session(order) {
            Ok(s) => {
                self.session = Some(s);
                Ok(())
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    fn receive(&mut self, i: usize, grad: Tensor, last: bool) -> candle_core::Result<()> {
        let grad = match self.pending[i].take() {
            Some(earlier) => (earlier + grad)?,
            None => grad,
        };
        if !last {
            self.pending[i] = Some(grad);
            return Ok(());
        }
        let _span = crate::profile::scope("backward: optimizer step inside backward");
        self.step(i, grad).map_err(|e| self.fail(e))
    }
}
