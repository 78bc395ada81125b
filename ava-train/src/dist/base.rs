//! The collectives trait: the only way the engine talks to other ranks.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

/// How long a rank waiting for the others goes on once the stop flag is set: the others are
/// normally finishing the same step and arrive well within it; ranks that do not are stuck.
pub const STOP_GRACE: Duration = Duration::from_secs(1);

/// What a collective call can fail with. The MPI implementation never returns one (MPI's
/// default error handler ends the job, and `mpirun` names the rank that died); the
/// in-process group does, when a peer is gone or late.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A rank left the group (its thread returned or panicked).
    #[error("rank {rank} left the group during {what}; this rank stops too (see rank {rank}'s error)")]
    PeerGone {
        /// The rank that left.
        rank: usize,
        /// The collective under way.
        what: &'static str,
    },
    /// Not every rank joined a collective in time.
    #[error(
        "{what}: ranks {missing:?} did not join within {seconds} s; they are stuck or dead (see their errors), so \
         this rank stops"
    )]
    Timeout {
        /// The collective under way.
        what: &'static str,
        /// The ranks that had not arrived.
        missing: Vec<usize>,
        /// The timeout.
        seconds: u64,
    },
    /// The stop flag (a signal) was set while this rank waited for others that did not
    /// arrive within [`STOP_GRACE`], or left: the wait gave up instead of blocking the stop.
    #[error(
        "stopped while waiting for the other ranks: ranks {missing:?} had not joined the {what} (stuck, or stopping \
         too)"
    )]
    Stopped {
        /// The collective under way.
        what: &'static str,
        /// The ranks that had not arrived.
        missing: Vec<usize>,
    },
    /// The ranks called collectives with buffers that do not match.
    #[error("{what}: {message}")]
    Mismatch {
        /// The collective.
        what: &'static str,
        /// What differed.
        message: String,
    },
}

/// The collectives data-parallel training needs, over the ranks of one job. Every rank
/// calls the same collectives in the same order with buffers of the same length; `counts`
/// split a buffer into consecutive ranges, range `r` belonging to rank `r`.
///
/// Sums add the ranks' values in rank order where the implementation controls it (the
/// in-process group); MPI chooses its own order, which for two ranks is the same number.
pub trait Collectives: std::fmt::Debug {
    /// This process's rank, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// What carries the data, for the run header (e.g. "MPI (Open MPI v4.1.4)").
    fn describe(&self) -> String;
    /// Element-wise sum over the ranks, the result on every rank.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), DistError>;
    /// Element-wise sum over the ranks in f64 (norms, losses).
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<(), DistError>;
    /// Element-wise maximum over the ranks (agreeing on flags).
    fn all_reduce_max(&self, buf: &mut [u64]) -> Result<(), DistError>;
    /// Element-wise sum over the ranks, of which rank `r` needs only range `r` of `counts`:
    /// on return that range holds the sum, the rest of `buf` is unspecified.
    fn reduce_scatter_sum(&self, buf: &mut [f32], counts: &[usize]) -> Result<(), DistError>;
    /// Range `r` of `counts` comes from rank `r`: on return every rank holds every range.
    fn all_gather(&self, buf: &mut [u8], counts: &[usize]) -> Result<(), DistError>;
    /// `root`'s bytes on every rank.
    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<(), DistError>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), DistError>;

    /// From now on (`Some`) a wait for the other ranks still unanswered [`STOP_GRACE`] after
    /// `stop` is set gives up with [`DistError::Stopped`]; `None` ends that (the waits after
    /// a step, for the save it ends with, must complete). Returns whether this group's waits
    /// can give up: by default (one rank, MPI, whose collectives cannot be interrupted) they
    /// cannot, and nothing changes.
    fn watch_stop(&self, _stop: Option<Arc<AtomicBool>>) -> bool {
        false
    }

    /// Starts [`Collectives::reduce_scatter_sum`] of `buf` and returns at once when the
    /// group can run it beside the caller's work (MPI runs it on a communication thread);
    /// [`Pending::wait`] hands the buffer back. Started reduce-scatters run in the order
    /// they were started, apart from the blocking collectives. By default it runs now.
    fn start_reduce_scatter(&self, mut buf: Vec<f32>, counts: Vec<usize>) -> Result<Pending, DistError> {
        let started = Instant::now();
        self.reduce_scatter_sum(&mut buf, &counts)?;
        Ok(Pending::Done(Ok((buf, started.elapsed()))))
    }
}

/// A reduce-scatter under way (or done): see [`Collectives::start_reduce_scatter`].
#[derive(Debug)]
pub enum Pending {
    /// Finished when it was started: the buffer and how long it took.
    Done(Result<(Vec<f32>, Duration), DistError>),
    /// Running elsewhere; the result arrives on this channel.
    Running(Receiver<Result<(Vec<f32>, Duration), DistError>>),
}

impl Pending {
    /// Waits for the collective: the reduced buffer, and how long the collective itself ran
    /// (from when it began, not from when it was started, if others were queued before it).
    pub fn wait(self) -> Result<(Vec<f32>, Duration), DistError> {
        match self {
            Self::Done(result) => result,
            Self::Running(rx) => rx.recv().unwrap_or(Err(DistError::Mismatch {
                what: "reduce-scatter",
                message: "the communication thread ended before finishing it (see the error before this one)".into(),
            })),
        }
    }
}

/// Checks that `counts` has one entry per rank and covers `len` elements.
pub(crate) fn check_counts(what: &'static str, counts: &[usize], size: usize, len: usize) -> Result<(), DistError> {
    if counts.len() != size || counts.iter().sum::<usize>() != len {
        return Err(DistError::Mismatch {
            what,
            message: format!("counts {counts:?} for {size} ranks do not cover a buffer of {len}"),
        });
    }
    Ok(())
}

/// The offsets of the ranges `counts` describes.
pub(crate) fn offsets(counts: &[usize]) -> Vec<usize> {
    counts.iter().scan(0, |at, &c| Some(std::mem::replace(at, *at + c))).collect()
}
