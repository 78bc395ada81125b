//! Buffers that live on a CUDA device, and the stream a plugin launches on (contract 2).
//!
//! A plugin whose [manifest](crate::Manifest) lists [`Device::Cuda`](crate::Device::Cuda)
//! promises the `*_cuda` calls ([`Optimizer::step_cuda`](crate::Optimizer::step_cuda),
//! [`AttentionKernel::forward_cuda`](crate::AttentionKernel::forward_cuda) and, with a
//! backward pass, [`AttentionKernel::backward_cuda`](crate::AttentionKernel::backward_cuda)).
//! On a CUDA run the host hands those calls [`CudaBuf`]s instead of host slices; it never
//! copies a device buffer to the host for a plugin that does not take them (it refuses such a
//! plugin by name before training).
//!
//! ## The rules of a device call
//!
//! - **The host owns the memory.** Every [`CudaBuf`] was allocated by the host at the size
//!   the plugin declared (`state_layout`, `saved_len`, `workspace_len`), exactly as on the
//!   CPU. The plugin must not free a pointer, and must not keep one beyond the call: the
//!   host may move, reuse or offload the buffer as soon as the call returns.
//! - **Launch on `stream`, and only on it.** The plugin enqueues its kernels (and any
//!   memset or copy between the buffers it was given) on [`CudaStream::handle`] and returns
//!   without waiting for them: the host orders everything else on that stream after them.
//!   It must not synchronize the device or the context (`cuCtxSynchronize`,
//!   `cudaDeviceSynchronize`), nor launch on the legacy default stream unless that is the
//!   stream it was given, nor create streams of its own for this work.
//! - **The host's context is current.** The calling thread has the host's CUDA context for
//!   [`CudaStream::ordinal`] current (`cuCtxGetCurrent` returns it); every buffer of a call
//!   is on that device. Do not create, push or pop contexts.
//! - **Do not link CUDA.** A plugin library must not link `libcuda`, `libcudart` or any
//!   other CUDA library at build time: the same `ava` binary runs on machines without a
//!   GPU, and a library that needs one to be opened would fail to load there. Load the
//!   driver at run time instead (e.g. the `cudarc` crate with its
//!   `fallback-dynamic-loading` feature), only when a `*_cuda` call first arrives.
//!
//! Errors are returned as usual ([`PluginError`]); a plugin that cannot launch (no kernel
//! image for this GPU, a driver call failing) says so in the message rather than panicking.

use abi_stable::StableAbi;

use crate::{DType, PluginError};

/// A contiguous buffer in the memory of one CUDA device, owned by the host.
///
/// The pointer is a `CUdeviceptr` (a device address, not dereferenceable on the host). A
/// buffer of length 0 may have any pointer, 0 included, and must not be read.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaBuf {
    /// The device address of the first element (`CUdeviceptr`).
    pub ptr: u64,
    /// Number of elements (not bytes).
    pub len: u64,
    /// Element type.
    pub dtype: DType,
    /// The device the memory is on (CUDA device ordinal, as in `cuDeviceGet`).
    pub ordinal: u32,
}

impl CudaBuf {
    /// An empty buffer on device `ordinal` (what the host passes for "none", e.g. no
    /// segment ids or a zero-length workspace).
    pub fn empty(dtype: DType, ordinal: u32) -> Self {
        Self { ptr: 0, len: 0, dtype, ordinal }
    }

    /// Size in bytes: `len` times the element size.
    pub fn bytes(&self) -> u64 {
        self.len * self.dtype.size() as u64
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Checks that the buffer holds `len` elements of `dtype`; the error names the buffer
    /// (`what`), what was wanted and what it got.
    pub fn expect(&self, what: &str, dtype: DType, len: usize) -> Result<(), PluginError> {
        if self.dtype == dtype && self.len == len as u64 {
            return Ok(());
        }
        Err(PluginError::invalid_input(format!(
            "{what} has {} {} elements, expected {len} {}",
            self.len,
            self.dtype.as_str(),
            dtype.as_str()
        )))
    }
}

/// The CUDA stream a device call launches its work on.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaStream {
    /// The `CUstream` handle; 0 is the legacy default stream.
    pub handle: u64,
    /// The device the stream belongs to (CUDA device ordinal); every buffer of the call is on
    /// it, and the host's context for it is current on the calling thread.
    pub ordinal: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_buf_sizes_and_expectations() {
        let b = CudaBuf { ptr: 0x7f00_0000_0000, len: 12, dtype: DType::BF16, ordinal: 0 };
        assert_eq!(b.bytes(), 24);
        assert!(!b.is_empty());
        assert!(CudaBuf::empty(DType::F32, 1).is_empty());
        assert_eq!(CudaBuf::empty(DType::F32, 1).bytes(), 0);

        assert_eq!(b.expect("q", DType::BF16, 12), Ok(()));
        let e = b.expect("q", DType::F32, 12).unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::InvalidInput);
        assert_eq!(e.message.as_str(), "q has 12 bf16 elements, expected 12 f32");
        let e = b.expect("grad", DType::BF16, 16).unwrap_err();
        assert_eq!(e.message.as_str(), "grad has 12 bf16 elements, expected 16 bf16");
    }
}
