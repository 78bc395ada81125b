//! The MPI group (rsmpi over the system's MPI, e.g. Open MPI): `mpirun -np N ava train`.
//!
//! MPI's default error handler ends the whole job when a call fails, and `mpirun` stops
//! every rank when one dies and names it, so these calls return no errors of their own.
//!
//! The blocking collectives run on the caller's thread over the world communicator. The
//! reduce-scatters started with [`Collectives::start_reduce_scatter`] (stage 2's, during
//! backward) run on a communication thread of their own, over a duplicate of it, so they
//! proceed while the caller computes: two communicators keep the two streams of collectives
//! apart, and MPI is asked for `MPI_THREAD_MULTIPLE`. An MPI without it gets no thread, and
//! those reduce-scatters run when started.

use std::sync::mpsc::{Sender, channel};
use std::thread::JoinHandle;
use std::time::Instant;

use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Threading;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;

use super::base::{Collectives, DistError, Pending, check_counts, offsets};

/// The world communicator of an MPI job; MPI is finalized when it is dropped.
pub struct MpiGroup {
    /// The communication thread (None: the MPI has no `MPI_THREAD_MULTIPLE`).
    comm: Option<CommThread>,
    // Field order: the communicator goes before the universe that finalizes MPI.
    world: SimpleCommunicator,
    _universe: mpi::environment::Universe,
    version: String,
}

/// A reduce-scatter for the communication thread, and where its result goes.
struct Job {
    buf: Vec<f32>,
    counts: Vec<usize>,
    reply: Sender<Result<(Vec<f32>, std::time::Duration), DistError>>,
}

/// The communication thread and the queue it takes jobs from.
struct CommThread {
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for CommThread {
    fn drop(&mut self) {
        // Closing the queue ends the thread after the jobs in it; it must end (and free its
        // communicator) before MPI is finalized.
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A communicator moved to the communication thread. Sound because MPI was initialized
/// with `MPI_THREAD_MULTIPLE` (any thread may call it) and only that thread uses it.
struct Moved(SimpleCommunicator);
// SAFETY: see above: the MPI library is thread-safe at MPI_THREAD_MULTIPLE, and the handle
// is used by one thread at a time (the one it was moved to).
unsafe impl Send for Moved {}

impl CommThread {
    fn start(comm: SimpleCommunicator) -> Self {
        let (jobs, queue) = channel::<Job>();
        let comm = Moved(comm);
        let thread = std::thread::Builder::new()
            .name("ava-mpi-comm".into())
            .spawn(move || {
                let comm = comm;
                for Job { mut buf, counts, reply } in queue {
                    let started = Instant::now();
                    let result = reduce_scatter_on(&comm.0, &mut buf, &counts).map(|()| (buf, started.elapsed()));
                    let _ = reply.send(result); // a caller that stopped waiting has gone
                }
            })
            .expect("the communication thread starts");
        Self { jobs: Some(jobs), thread: Some(thread) }
    }
}

impl std::fmt::Debug for MpiGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiGroup").field("rank", &self.world.rank()).field("size", &self.world.size()).finish()
    }
}

impl MpiGroup {
    /// Initializes MPI (once per process); `None` if it was initialized already.
    pub fn init() -> Option<Self> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)?;
        let world = universe.world();
        let comm = (threading == Threading::Multiple).then(|| CommThread::start(world.duplicate()));
        let version = mpi::environment::library_version().unwrap_or_else(|_| "MPI".into());
        // "Open MPI v4.1.4, package: ..., ident: ...": the name and version are enough.
        let version = version.split([',', '\n']).next().unwrap_or("MPI").trim().to_string();
        Some(Self { comm, world, _universe: universe, version })
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
        reduce_scatter_on(&self.world, buf, counts)
    }

    fn start_reduce_scatter(&self, mut buf: Vec<f32>, counts: Vec<usize>) -> Result<Pending, DistError> {
        let Some(jobs) = self.comm.as_ref().and_then(|c| c.jobs.as_ref()) else {
            let started = Instant::now();
            self.reduce_scatter_sum(&mut buf, &counts)?;
            return Ok(Pending::Done(Ok((buf, started.elapsed()))));
        };
        check_counts("reduce-scatter", &counts, self.size(), buf.len())?;
        let (reply, result) = channel();
        // The thread outlives every job (it ends when the group is dropped).
        jobs.send(Job { buf, counts, reply }).expect("the communication thread is running");
        Ok(Pending::Running(result))
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

/// Reduce-scatter over `comm`. MPI's reduce-scatter with uneven ranges
/// (`MPI_Reduce_scatter`) is not in rsmpi: one reduce to each range's owner, which moves
/// the same bytes. rsmpi has no `MPI_IN_PLACE` either, so the owner copies its range out as
/// the send buffer: in pieces of [`REDUCE_PIECE`] values (every rank cuts the same pieces),
/// so the copy is that small however large the bucket.
fn reduce_scatter_on(comm: &SimpleCommunicator, buf: &mut [f32], counts: &[usize]) -> Result<(), DistError> {
    check_counts("reduce-scatter", counts, comm.size() as usize, buf.len())?;
    let me = comm.rank() as usize;
    let mut send = Vec::new(); // (≤ REDUCE_PIECE,) f32, the owner's copy of one piece
    for (r, (&at, &n)) in offsets(counts).iter().zip(counts).enumerate() {
        let root = comm.process_at_rank(r as i32);
        for piece in (at..at + n).step_by(REDUCE_PIECE) {
            let range = piece..(piece + REDUCE_PIECE).min(at + n);
            if r == me {
                send.clear();
                send.extend_from_slice(&buf[range.clone()]);
                root.reduce_into_root(&send[..], &mut buf[range], SystemOperation::sum());
            } else {
                root.reduce_into(&buf[range], SystemOperation::sum());
            }
        }
    }
    Ok(())
}

/// Values per reduce in [`reduce_scatter_on`]: 256 KiB of f32.
const REDUCE_PIECE: usize = 1 << 16;

/// An MPI count: buffers are bucketed well below 2 GiB elements.
fn count(n: usize) -> i32 {
    i32::try_from(n).expect("collective buffers are bucketed below 2^31 elements")
}
