//! Data-parallel training across ranks: the collectives trait every rank talks through,
//! its implementations (one process, threads of one process, MPI), how the parameters are
//! shared out under ZeRO, and the engine's side of each stage (`zero`).
//!
//! Nothing outside this module calls MPI; NCCL would be another [`Collectives`].

mod base;
mod gather;
#[cfg(feature = "mpi")]
mod mpi;
mod reduce;
mod single;
mod threads;
mod zero;

use std::sync::Arc;

pub use base::{Collectives, DistError, Pending, STOP_GRACE};
pub use gather::Gathered;
#[cfg(feature = "mpi")]
pub use mpi::MpiGroup;
pub use reduce::{CommTimes, IN_FLIGHT, ReduceInBackward};
pub use single::Single;
pub use threads::{ThreadRank, thread_group};
pub use zero::{Zero, owners};

/// Environment variables a launcher sets for each rank: Open MPI's, then the PMI ones
/// MPICH and Slurm set.
const SIZE_VARS: &[&str] = &["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"];
const LOCAL_SIZE_VARS: &[&str] = &["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"];

/// The world size a launcher (`mpirun`) announced in the environment, if any.
pub fn launched_size() -> Option<usize> {
    SIZE_VARS.iter().find_map(|v| std::env::var(v).ok()?.parse().ok())
}

/// Ranks sharing this machine (for the default thread count), 1 without a launcher.
pub fn local_size() -> usize {
    LOCAL_SIZE_VARS.iter().find_map(|v| std::env::var(v).ok()?.parse().ok()).unwrap_or(1).max(1)
}

/// How this process joins its job.
pub enum Group {
    /// Alone.
    Single,
    /// One rank of an MPI job.
    #[cfg(feature = "mpi")]
    Mpi(Arc<MpiGroup>),
}

impl Group {
    /// The collectives of this group.
    pub fn collectives(&self) -> Arc<dyn Collectives> {
        match self {
            Self::Single => Arc::new(Single),
            #[cfg(feature = "mpi")]
            Self::Mpi(g) => g.clone(),
        }
    }

    /// Ends the job after an error on this rank: MPI stops every rank (`mpirun` reports
    /// which one failed); alone, the process exits.
    pub fn abort(&self, code: i32) -> ! {
        match self {
            Self::Single => std::process::exit(code),
            #[cfg(feature = "mpi")]
            Self::Mpi(g) => g.abort(code),
        }
    }
}

/// Joins the job the environment describes: MPI when a launcher started this process as
/// one of several ranks, alone otherwise. A build without the `mpi` feature started by
/// `mpirun -np N` (N > 1) is an error: each copy would train alone on the same data.
pub fn join() -> Result<Group, String> {
    match launched_size() {
        Some(n) if n > 1 => join_mpi(n),
        _ => Ok(Group::Single),
    }
}

#[cfg(feature = "mpi")]
// The group's communicators are MPI handles, so it is neither Send nor Sync;
// it is in an Arc because the trainer holds every group as `Arc<dyn Collectives>`.
#[allow(clippy::arc_with_non_send_sync)]
fn join_mpi(_n: usize) -> Result<Group, String> {
    MpiGroup::init()
        .map(|g| Group::Mpi(Arc::new(g)))
        .ok_or_else(|| "MPI was initialized twice in this process".to_string())
}

#[cfg(not(feature = "mpi"))]
fn join_mpi(n: usize) -> Result<Group, String> {
    Err(format!(
        "this ava was started by an MPI launcher as one of {n} ranks, but it was built without MPI support, so \
         each copy would train alone: build it with `cargo build --release -p ava-cli --features mpi` (after \
         `apt-get install libopenmpi-dev openmpi-bin libclang1-14 libclang-common-14-dev`), or run it \
         without mpirun"
    ))
}
