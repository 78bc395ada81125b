//! A group of ranks that are threads of one process: the reference the MPI group is
//! checked against, and what the tests of the sharded trainer run on without `mpirun`.
//!
//! Every collective is one exchange: each rank deposits its bytes, the last to arrive
//! publishes all of them, and each rank computes its result from the ranks' contributions
//! in rank order (so sums add in rank order, the same on every rank).
//!
//! A rank waits for the others in slices of [`STOP_POLL`]: it gives up when one left the
//! group, after [`TIMEOUT`], or [`STOP_GRACE`] after the stop flag of
//! [`Collectives::watch_stop`] was set.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::base::{Collectives, DistError, STOP_GRACE, check_counts, offsets};

/// How long a rank waits for the others at one collective before it gives up.
const TIMEOUT: Duration = Duration::from_secs(120);

/// How often a waiting rank looks at its stop flag.
const STOP_POLL: Duration = Duration::from_millis(100);

/// One rank's wait at one collective.
struct Wait {
    what: &'static str,
    deadline: Instant,
    /// When this wait first saw the stop flag set.
    stop_seen: Option<Instant>,
}

#[derive(Default)]
struct Round {
    /// Rounds completed; a rank waits for the round it joined to be published.
    generation: u64,
    /// This round's contributions, by rank.
    slots: Vec<Option<Vec<u8>>>,
    /// The published contributions of the last round, until every rank has read them.
    published: Option<Arc<Vec<Vec<u8>>>>,
    /// Ranks that have yet to read `published`.
    readers: usize,
    /// A rank that left (dropped its handle).
    gone: Option<usize>,
}

struct Shared {
    size: usize,
    round: Mutex<Round>,
    changed: Condvar,
}

/// One rank's handle on an in-process group.
pub struct ThreadRank {
    rank: usize,
    shared: Arc<Shared>,
    /// Set by [`Collectives::watch_stop`].
    stop: Mutex<Option<Arc<AtomicBool>>>,
}

impl std::fmt::Debug for ThreadRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadRank").field("rank", &self.rank).field("size", &self.shared.size).finish()
    }
}

/// A group of `size` ranks: hand one handle to each thread.
pub fn thread_group(size: usize) -> Vec<ThreadRank> {
    let shared = Arc::new(Shared {
        size,
        round: Mutex::new(Round { slots: vec![None; size], ..Round::default() }),
        changed: Condvar::new(),
    });
    (0..size).map(|rank| ThreadRank { rank, shared: Arc::clone(&shared), stop: Mutex::new(None) }).collect()
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Round> {
        self.round.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl ThreadRank {
    /// Every rank's bytes, in rank order.
    fn exchange(&self, what: &'static str, bytes: Vec<u8>) -> Result<Arc<Vec<Vec<u8>>>, DistError> {
        let s = &*self.shared;
        let mut wait = Wait { what, deadline: Instant::now() + TIMEOUT, stop_seen: None };
        let mut round = s.lock();
        // The previous round's results must be read by everyone before its slots are reused.
        while round.published.is_some() {
            round = self.wait(round, &mut wait)?;
        }
        let generation = round.generation;
        round.slots[self.rank] = Some(bytes);
        if round.slots.iter().all(Option::is_some) {
            let all: Vec<Vec<u8>> = round.slots.iter_mut().map(|s| s.take().expect("every slot is filled")).collect();
            round.published = Some(Arc::new(all));
            round.readers = s.size;
            round.generation += 1;
            s.changed.notify_all();
        }
        while round.generation == generation {
            round = self.wait(round, &mut wait)?;
        }
        let out = Arc::clone(round.published.as_ref().expect("a published round stays until read"));
        round.readers -= 1;
        if round.readers == 0 {
            round.published = None;
            s.changed.notify_all();
        }
        Ok(out)
    }

    fn wait<'a>(&self, round: MutexGuard<'a, Round>, wait: &mut Wait) -> Result<MutexGuard<'a, Round>, DistError> {
        let what = wait.what;
        let missing = || (0..self.shared.size).filter(|&r| round.slots[r].is_none()).collect();
        let now = Instant::now();
        let stopping =
            self.stop.lock().unwrap_or_else(PoisonError::into_inner).as_ref().is_some_and(|s| s.load(Ordering::SeqCst));
        if stopping {
            // A rank that left after the stop was asked most likely stopped too.
            let seen = *wait.stop_seen.get_or_insert(now);
            if round.gone.is_some() || now.duration_since(seen) >= STOP_GRACE {
                return Err(DistError::Stopped { what, missing: missing() });
            }
        }
        if let Some(rank) = round.gone {
            return Err(DistError::PeerGone { rank, what });
        }
        let left = wait.deadline.saturating_duration_since(now);
        if left.is_zero() {
            return Err(DistError::Timeout { what, missing: missing(), seconds: TIMEOUT.as_secs() });
        }
        let slice = left.min(STOP_POLL);
        let (round, _) = self.shared.changed.wait_timeout(round, slice).unwrap_or_else(PoisonError::into_inner);
        Ok(round)
    }
}

impl Drop for ThreadRank {
    fn drop(&mut self) {
        let mut round = self.shared.lock();
        round.gone.get_or_insert(self.rank);
        self.shared.changed.notify_all();
    }
}

fn f32s(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

impl Collectives for ThreadRank {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.shared.size
    }
    fn describe(&self) -> String {
        format!("{} threads of one process", self.shared.size)
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), DistError> {
        let all = self.exchange("all-reduce", f32_bytes(buf))?;
        buf.fill(0.0);
        for part in all.iter() {
            for (b, v) in buf.iter_mut().zip(f32s(part)) {
                *b += v;
            }
        }
        Ok(())
    }

    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<(), DistError> {
        let all = self.exchange("all-reduce", buf.iter().flat_map(|v| v.to_le_bytes()).collect())?;
        buf.fill(0.0);
        for part in all.iter() {
            for (b, c) in buf.iter_mut().zip(part.chunks_exact(8)) {
                *b += f64::from_le_bytes(c.try_into().expect("8 bytes"));
            }
        }
        Ok(())
    }

    fn all_reduce_max(&self, buf: &mut [u64]) -> Result<(), DistError> {
        let all = self.exchange("all-reduce", buf.iter().flat_map(|v| v.to_le_bytes()).collect())?;
        for part in all.iter() {
            for (b, c) in buf.iter_mut().zip(part.chunks_exact(8)) {
                *b = (*b).max(u64::from_le_bytes(c.try_into().expect("8 bytes")));
            }
        }
        Ok(())
    }

    fn reduce_scatter_sum(&self, buf: &mut [f32], counts: &[usize]) -> Result<(), DistError> {
        check_counts("reduce-scatter", counts, self.size(), buf.len())?;
        let all = self.exchange("reduce-scatter", f32_bytes(buf))?;
        let (at, n) = (offsets(counts)[self.rank], counts[self.rank]);
        let mine = &mut buf[at..at + n];
        mine.fill(0.0);
        for part in all.iter() {
            for (b, v) in mine.iter_mut().zip(f32s(&part[at * 4..(at + n) * 4])) {
                *b += v;
            }
        }
        Ok(())
    }

    fn all_gather(&self, buf: &mut [u8], counts: &[usize]) -> Result<(), DistError> {
        check_counts("all-gather", counts, self.size(), buf.len())?;
        let starts = offsets(counts);
        let (at, n) = (starts[self.rank], counts[self.rank]);
        let all = self.exchange("all-gather", buf[at..at + n].to_vec())?;
        for (r, part) in all.iter().enumerate() {
            buf[starts[r]..starts[r] + counts[r]].copy_from_slice(part);
        }
        Ok(())
    }

    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<(), DistError> {
        let mine = if self.rank == root { buf.to_vec() } else { Vec::new() };
        let all = self.exchange("broadcast", mine)?;
        if all[root].len() != buf.len() {
            return Err(DistError::Mismatch {
                what: "broadcast",
                message: format!("rank {root} sent {} bytes into a buffer of {}", all[root].len(), buf.len()),
            });
        }
        buf.copy_from_slice(&all[root]);
        Ok(())
    }

    fn barrier(&self) -> Result<(), DistError> {
        self.exchange("barrier", Vec::new()).map(drop)
    }

    fn watch_stop(&self, stop: Option<Arc<AtomicBool>>) -> bool {
        *self.stop.lock().unwrap_or_else(PoisonError::into_inner) = stop;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` on every rank of a group of `n` threads; returns the ranks' results.
    fn on_ranks<T: Send>(n: usize, f: impl Fn(&ThreadRank) -> T + Sync) -> Vec<T> {
        let f = &f;
        std::thread::scope(|s| {
            let handles: Vec<_> = thread_group(n).into_iter().map(|g| s.spawn(move || f(&g))).collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        })
    }

    #[test]
    fn collectives_give_every_rank_the_combined_values() {
        let out = on_ranks(3, |g| {
            let r = g.rank() as f32;
            let mut sum = vec![r, 10.0 * r];
            g.all_reduce_sum(&mut sum).unwrap();
            let mut max = vec![g.rank() as u64 * 7];
            g.all_reduce_max(&mut max).unwrap();
            // Ranges of 1, 2 and 1 elements.
            let mut scattered = vec![r + 1.0; 4];
            g.reduce_scatter_sum(&mut scattered, &[1, 2, 1]).unwrap();
            let mine = match g.rank() {
                0 => scattered[..1].to_vec(),
                1 => scattered[1..3].to_vec(),
                _ => scattered[3..].to_vec(),
            };
            let mut gathered = vec![0u8; 6];
            let counts = [1, 2, 3];
            let at = [0, 1, 3][g.rank()];
            for b in &mut gathered[at..at + counts[g.rank()]] {
                *b = g.rank() as u8 + 1;
            }
            g.all_gather(&mut gathered, &counts).unwrap();
            let mut b = if g.rank() == 2 { vec![9u8, 8] } else { vec![0, 0] };
            g.broadcast(&mut b, 2).unwrap();
            g.barrier().unwrap();
            (sum, max, mine, gathered, b)
        });
        for (rank, (sum, max, mine, gathered, b)) in out.into_iter().enumerate() {
            assert_eq!(sum, vec![3.0, 30.0]);
            assert_eq!(max, vec![14]);
            assert_eq!(mine, if rank == 1 { vec![6.0, 6.0] } else { vec![6.0] });
            assert_eq!(gathered, vec![1, 2, 2, 3, 3, 3]);
            assert_eq!(b, vec![9, 8]);
        }
    }

    #[test]
    fn a_rank_that_leaves_stops_the_others_with_its_number() {
        let out = on_ranks(2, |g| {
            if g.rank() == 1 {
                return None;
            }
            let mut x = vec![1.0f32];
            // Rank 1's handle is dropped when its closure returns.
            Some(g.all_reduce_sum(&mut x).unwrap_err().to_string())
        });
        let message = out[0].as_ref().unwrap();
        assert!(message.contains("rank 1 left the group during all-reduce"), "{message}");
    }

    #[test]
    fn a_stop_ends_a_wait_for_a_rank_that_never_comes() {
        let stop = Arc::new(AtomicBool::new(false));
        let done = AtomicBool::new(false);
        let out = on_ranks(2, |g| {
            if g.rank() == 1 {
                // Stuck outside any collective (its handle held) until rank 0 is done.
                while !done.load(Ordering::SeqCst) {
                    std::thread::sleep(STOP_POLL);
                }
                return None;
            }
            g.watch_stop(Some(stop.clone()));
            // Asked to stop while rank 0 waits: without it, the wait would last TIMEOUT.
            let setter = {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(STOP_POLL * 2);
                    stop.store(true, Ordering::SeqCst);
                })
            };
            let err = g.all_reduce_sum(&mut [1.0]).unwrap_err();
            setter.join().unwrap();
            done.store(true, Ordering::SeqCst);
            Some(err)
        });
        let err = out[0].as_ref().unwrap();
        assert!(matches!(err, DistError::Stopped { what: "all-reduce", missing } if missing == &[1]), "{err}");
        assert!(
            err.to_string()
                .starts_with("stopped while waiting for the other ranks: ranks [1] had not joined the all-reduce")
        );
    }

    #[test]
    fn mismatched_counts_are_refused() {
        let g = thread_group(1).pop().unwrap();
        let e = g.reduce_scatter_sum(&mut [0.0; 3], &[2]).unwrap_err().to_string();
        assert!(e.contains("do not cover a buffer of 3"), "{e}");
    }
}
