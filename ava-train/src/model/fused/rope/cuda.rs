//! The heads move's device half (`cuda` feature): the split or merge of heads with the
//! rotary embedding, `heads_*` of `kernels/fused.cu`, launched with `launch::heads`'s grid on
//! candle's stream, and the rotary tables' copy on the device, uploaded once and kept with
//! the tables. The math is the parent op's (its CPU half).

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaSlice, PushKernelArg};
use candle_core::cuda::{CudaDevice, CudaStorage, DeviceId, WrapErr};
use candle_core::{DType, Layout, Result, Shape, Tensor, bail};

use super::super::cuda::{MODULE, PTX, by_type, config, int, storage_tensor, uninit, view, with_cuda};
use super::super::launch;
use super::RopeTables;

/// The rotary tables (cos, sin) on a device, (P, D) f32 each.
type DeviceTables = Arc<(CudaSlice<f32>, CudaSlice<f32>)>;

/// The rotary tables' device copy, made on first use and kept with the tables (one device:
/// a run trains on one GPU).
#[derive(Default)]
pub(crate) struct TableCache(Mutex<Option<(DeviceId, DeviceTables)>>);

impl std::fmt::Debug for TableCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TableCache")
    }
}

/// The f32 tables (cos, sin) of `rope` on `dev`, uploaded once.
fn device_tables(rope: &RopeTables, dev: &CudaDevice) -> Result<DeviceTables> {
    let mut cache = rope.device_cache().0.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((id, t)) = cache.as_ref()
        && *id == dev.id()
    {
        return Ok(t.clone());
    }
    let (cos, sin) = rope.f32_tables();
    let t = Arc::new((dev.clone_htod(cos)?, dev.clone_htod(sin)?)); // (P, D) each
    *cache = Some((dev.id(), t.clone()));
    Ok(t)
}

/// The shape and rotation of one heads move (see the parent module).
pub(super) struct HeadsMove<'a> {
    pub b: usize,
    pub c: usize,
    pub t: usize,
    pub d: usize,
    /// (B, C, T, D) → (B·T, C·D); else the split.
    pub merge: bool,
    /// The transposed rotation (backward).
    pub transposed: bool,
    pub rope: Option<&'a RopeTables>,
    /// (B·T,) each token's position; `None`: its index t.
    pub positions: Option<&'a [u32]>,
}

/// Moves `src` (B·T·C·D elements) as `m` says, rotating when it has tables.
pub(super) fn heads(src: &CudaStorage, l: &Layout, m: &HeadsMove<'_>) -> Result<CudaStorage> {
    let dev = src.device();
    let n = m.b * m.c * m.t * m.d;
    let tables = m.rope.map(|r| device_tables(r, dev)).transpose()?;
    let positions = m.positions.map(|p| dev.clone_htod(p)).transpose()?; // (B·T,) u32
    by_type!(src.dtype(), "heads", |T, s| {
        let sv = view::<T>(src, l, "heads")?;
        let mut dst = uninit::<T>(dev, n)?;
        if n > 0 {
            let f = dev.get_or_load_custom_func(&format!("heads_{s}"), MODULE, PTX)?;
            let null = 0u64; // a null device pointer: no tables, or positions t
            let dims = [int(m.b, "batch")?, int(m.c, "heads")?, int(m.t, "tokens")?, int(m.d, "head size")?];
            let (merge, transposed) = (i32::from(m.merge), i32::from(m.transposed));
            let mut b = f.builder();
            b.arg(&sv).arg(&mut dst);
            match &tables {
                Some(t) => b.arg(&t.0).arg(&t.1),
                None => b.arg(&null).arg(&null),
            };
            match &positions {
                Some(p) => b.arg(p),
                None => b.arg(&null),
            };
            b.arg(&dims[0]).arg(&dims[1]).arg(&dims[2]).arg(&dims[3]).arg(&merge).arg(&transposed);
            // SAFETY: heads' signature (pointers are 64-bit, so the null stands for one); the
            // tables hold every position below their length, which split_heads checked.
            unsafe { b.launch(config(launch::heads(n, tables.is_some())?)) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(dst, dev.clone()))
    })
}

/// [`heads`] on a tensor (backward's gradient), giving a tensor of `shape`.
pub(super) fn heads_tensor(src: &Tensor, m: &HeadsMove<'_>, shape: Shape) -> Result<Tensor> {
    with_cuda(src, "heads", |s, l| Ok(storage_tensor(heads(s, l, m)?, shape)))
}
