//! The built-ins' GPU kernels (`cuda` feature): kernels/optim.cu (adamw, sgd) and
//! kernels/attention.cu (standard) as PTX. Loading and launching are
//! [`ava_kernels::cuda`]'s, the path every GPU plugin takes (the `flash` plugin included).

pub(crate) use ava_kernels::cuda::{Ptx, THREADS, arg, blocks, launch};

/// kernels/optim.cu: adamw's and sgd's steps.
pub(crate) const OPTIM: Ptx = Ptx::new("optim", concat!(include_str!(concat!(env!("OUT_DIR"), "/optim.ptx")), "\0"));

/// kernels/attention.cu: standard's dense attention.
pub(crate) const ATTENTION: Ptx =
    Ptx::new("attention", concat!(include_str!(concat!(env!("OUT_DIR"), "/attention.ptx")), "\0"));
