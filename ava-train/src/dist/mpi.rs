//! The MPI group (rsmpi over the system's MPI, e.g. Open MPI): `mpirun -np N ava train`.
//!
//! MPI's default error handler ends the whole job when a call fails, and `mpirun` stops
//! every rank when one dies and names it, so these calls return no errors of their own.
//! Only the main thread calls MPI (`MPI_THREAD_SINGLE` is enough).

use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;

use super::base::{Collectives, DistError, check_counts, offsets};

/// The world communicator of an MPI job; MPI is finalized when it is dropped.
pub struct MpiGroup {
    // Field order: the communicator goes before the universe that finalizes MPI.
    world: SimpleCommunicator,
    _universe: mpi::environment::Universe,
    version: String,
}

impl std::fmt::Debug for MpiGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiGroup").field("rank", &self.world.rank()).field("size", &self.world.size()).finish()
    }
}

impl MpiGroup {
    /// Initializes MPI (once per process); `None` if it was initialized already.
    pub fn init() -> Option<Self> {
        let universe = mpi::initialize()?;
        let world = universe.world();
        let version = mpi::environment::library_version().unwrap_or_else(|_| "MPI".into());
        // "Open MPI v4.1.4, package: ..., ident: ...": the name and version are enough.
        let version = version.split([',', '\n']).next().unwrap_or("MPI").trim().to_string();
        Some(Self { world, _universe: universe, version })
    }

    /// Ends every rank of the job with `code` (after an error on this rank).
    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}

impl Collectives for MpiGroup {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }
    fn size(&self) -> usize {
        self.world.size() as usize
    }
    fn describe(&self) -> String {
        format!("MPI ({})", self.version)
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), DistError> {
        let send = buf.to_vec();
        self.world.all_reduce_into(&send[..], buf, SystemOperation::sum());
        Ok(())
    }

    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<(), DistError> {
        let send = buf.to_vec();
        self.world.all_reduce_into(&send[..], buf, SystemOperation::sum());
        Ok(())
    }

    fn all_reduce_max(&self, buf: &mut [u64]) -> Result<(), DistError> {
        let send = buf.to_vec();
        self.world.all_reduce_into(&send[..], buf, SystemOperation::max());
        Ok(())
    }

    fn reduce_scatter_sum(&self, buf: &mut [f32], counts: &[usize]) -> Result<(), DistError> {
        check_counts("reduce-scatter", counts, self.size(), buf.len())?;
        // MPI's reduce-scatter with uneven ranges (MPI_Reduce_scatter) is not in rsmpi: one
        // reduce to each range's owner, which moves the same bytes.
        let me = self.rank();
        for (r, (&at, &n)) in offsets(counts).iter().zip(counts).enumerate() {
            if n == 0 {
                continue;
            }
            let root = self.world.process_at_rank(r as i32);
            if r == me {
                let send = buf[at..at + n].to_vec();
                root.reduce_into_root(&send[..], &mut buf[at..at + n], SystemOperation::sum());
            } else {
                root.reduce_into(&buf[at..at + n], SystemOperation::sum());
            }
        }
        Ok(())
    }

    fn all_gather(&self, buf: &mut [u8], counts: &[usize]) -> Result<(), DistError> {
        check_counts("all-gather", counts, self.size(), buf.len())?;
        let starts = offsets(counts);
        let me = self.rank();
        let send = buf[starts[me]..starts[me] + counts[me]].to_vec();
        let counts_i: Vec<i32> = counts.iter().map(|&c| count(c)).collect();
        let displs: Vec<i32> = starts.iter().map(|&c| count(c)).collect();
        let mut partition = PartitionMut::new(buf, counts_i, displs);
        self.world.all_gather_varcount_into(&send[..], &mut partition);
        Ok(())
    }

    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<(), DistError> {
        let root = self.world.process_at_rank(root as i32);
        for piece in buf.chunks_mut(1 << 30) {
            root.broadcast_into(piece);
        }
        Ok(())
    }

    fn barrier(&self) -> Result<(), DistError> {
        self.world.barrier();
        Ok(())
    }
}

/// An MPI count: buffers are bucketed well below 2 GiB elements.
fn count(n: usize) -> i32 {
    i32::try_from(n).expect("collective buffers are bucketed below 2^31 elements")
}
