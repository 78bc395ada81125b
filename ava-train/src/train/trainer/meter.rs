//! The run's memory meter ([`Meter`]), built with the trainer: the one place that knows
//! whether the run's memory is the counting allocator's (the host) or the device pool's (a
//! GPU). The stages read what is held, start a step's high-water mark, give unused device
//! memory back and learn the run's limit through it, without asking which device they run on.

use super::*;
use crate::device::DeviceLimit;

/// The run's memory meter (see the module docs).
pub(super) struct Meter {
    /// Where the run computes: the trainer's device, held here once.
    device: Device,
    /// `memory.hard_limit`, where the run enforces it; `None` without one.
    limit: Option<Limit>,
}

/// Where `memory.hard_limit` is enforced.
enum Limit {
    /// On the host: the counting allocator's count, checked between micro-steps.
    Host(u64),
    /// On a GPU: the capped pool the device's allocations come from, held for the run
    /// (dropping it destroys the pool and gives the device its default pool back).
    Device(DeviceLimit),
}

impl Meter {
    /// The meter of a run on `device` with `config`'s hard limit: the capped pool
    /// `device_limit` on a GPU (made before anything of the run was allocated there), else the
    /// counting allocator's limit.
    pub(super) fn new(device: Device, config: &Config, device_limit: Option<DeviceLimit>) -> Self {
        let host = Some(config.memory.hard_limit.0).filter(|&l| l > 0 && !device.is_cuda());
        let limit = match device_limit {
            Some(pool) => Some(Limit::Device(pool)),
            None => host.map(Limit::Host),
        };
        Self { device, limit }
    }

    /// The device the run computes on.
    pub(super) fn device(&self) -> &Device {
        &self.device
    }

    /// The host limit in bytes (`None` on a GPU, or without `memory.hard_limit`).
    pub(super) fn host_limit(&self) -> Option<u64> {
        match &self.limit {
            Some(Limit::Host(bytes)) => Some(*bytes),
            _ => None,
        }
    }

    /// The device pool's cap in bytes (`None` on the host, or without `memory.hard_limit`).
    pub(super) fn device_limit(&self) -> Option<u64> {
        match &self.limit {
            Some(Limit::Device(pool)) => Some(pool.bytes()),
            _ => None,
        }
    }

    /// Hands the counting allocator the host limit again (none on a GPU): at the start of the
    /// run, and after the out-of-memory test hook lowered it for one micro-step.
    pub(super) fn set_host_limit(&self) {
        memory::set_limit(self.host_limit());
    }

    /// Bytes the run's allocations hold now: the device pool's on a GPU, the counting
    /// allocator's on the host.
    pub(super) fn held_now(&self) -> u64 {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(gpu) = &self.device {
            return memory::device::read(gpu).map_or(0, |m| m.used);
        }
        memory::current()
    }

    /// Starts a new high-water mark of the memory the step holds: the counting allocator's,
    /// and on a GPU the device pool's.
    pub(super) fn reset_step_peak(&self) -> Result<(), TrainError> {
        memory::reset_peak();
        #[cfg(feature = "cuda")]
        if let Device::Cuda(gpu) = &self.device {
            memory::device::reset_peak(gpu).map_err(TrainError::candle)?;
        }
        Ok(())
    }

    /// After an out-of-memory on a GPU, once the failed attempt's tensors are dropped: the
    /// device pool's unused memory back to the driver (it keeps what it reserves otherwise),
    /// so the retry at a smaller micro-batch starts from a compact pool, not a fragmented
    /// reserve. Nothing on the host.
    pub(super) fn release_unused(&self) -> Result<(), TrainError> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(gpu) = &self.device {
            memory::device::release_unused(gpu).map_err(TrainError::candle)?;
        }
        Ok(())
    }

    /// The GPU's memory after a step (none on the CPU).
    pub(super) fn device_memory(&self) -> Result<Option<memory::DeviceMemory>, TrainError> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(gpu) = &self.device {
            return memory::device::read(gpu).map(Some).map_err(TrainError::candle);
        }
        Ok(None)
    }

    /// Whether a failed forward or backward ran out of device memory (candle's CUDA
    /// allocation error): the step can back off as a crossed hard limit does on the host.
    pub(super) fn is_out_of_memory(&self, e: &candle_core::Error) -> bool {
        self.device.is_cuda() && crate::train::says_out_of_device_memory(&e.to_string())
    }
}
