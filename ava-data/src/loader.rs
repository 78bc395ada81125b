//! [`Loader`]: builds [`Batch`]es of a split on background threads and delivers them in order.
//!
//! Batch `i` holds sequences `i·B .. (i+1)·B`, so a batch is a pure function of its index: the
//! stream is the same whatever the worker count, and a run resumes exactly from a saved
//! [`Loader::position`]. With `W > 0` workers, worker `w` builds batches `start + w`,
//! `start + w + W`, ...; a worker only starts batch `i` once `i < position + W·prefetch_factor`,
//! so at most `W·prefetch_factor` finished batches wait in the queue (backpressure) and the
//! batch the consumer needs next can always be built (no deadlock).
//!
//! Every wait can be interrupted: with a stop flag ([`Loader::watch`], set by the binary's
//! signal handler), a [`Loader::next`] waiting for a batch that is not ready looks at the
//! flag every [`STOP_POLL`] and gives up with [`DataError::Stopped`] once it is set; and
//! dropping the loader waits at most [`JOIN_GRACE`] for a worker still building a batch (one
//! stuck in a read that never returns is left behind, not waited for forever). Building a
//! batch itself, on the caller's thread without workers, is not interrupted.

use std::collections::BTreeMap;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::dataset::{Dataset, Split};
use super::error::DataError;

/// Which rows of each global batch a rank reads: with `world` ranks a global batch holds
/// `world × batch_size` sequences and rank `r` reads rows `r·B .. (r+1)·B` of it, so the
/// ranks together read what one process with the whole batch would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
}

impl Share {
    /// One process reading whole batches.
    pub const WHOLE: Share = Share { rank: 0, world: 1 };
}

/// `batch_size` sequences of `seq_len + 1` tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Index of the batch in its split's stream.
    pub index: u64,
    /// Number of sequences `B`.
    pub batch_size: usize,
    /// Sequence length `T` (inputs and targets are `T` tokens each).
    pub seq_len: usize,
    /// `(B, T + 1)` tokens, row-major.
    pub tokens: Vec<u32>,
    /// With `data.packing: document`, `(B, T)`: each input token's document within its row,
    /// numbered from 0 at the row's first token (so non-decreasing along a row). `None` when
    /// the source does not pack documents.
    pub segments: Option<Vec<u32>>,
}

impl Batch {
    /// Builds batch `index` of `split`: sequences `index·batch_size .. (index+1)·batch_size`.
    ///
    /// # Panics
    /// If the dataset returns a sequence that is not `seq_len + 1` tokens long.
    pub fn build(dataset: &dyn Dataset, split: Split, index: u64, batch_size: usize, seq_len: usize) -> Self {
        Self::build_share(dataset, split, index, batch_size, seq_len, Share::WHOLE)
    }

    /// This rank's `batch_size` rows of global batch `index` (see [`Share`]).
    pub fn build_share(
        dataset: &dyn Dataset,
        split: Split,
        index: u64,
        batch_size: usize,
        seq_len: usize,
        share: Share,
    ) -> Self {
        let mut tokens = Vec::with_capacity(batch_size * (seq_len + 1));
        let packed = dataset.packs_documents();
        let mut segments = Vec::with_capacity(if packed { batch_size * seq_len } else { 0 });
        let first = (index * share.world as u64 + share.rank as u64) * batch_size as u64;
        for row in 0..batch_size as u64 {
            let sequence = dataset.sequence(split, first + row, seq_len);
            assert_eq!(sequence.len(), seq_len + 1, "dataset returned a sequence of the wrong length");
            tokens.extend_from_slice(&sequence);
            if packed {
                let starts = dataset.document_starts(split, first + row, seq_len);
                let starts = starts.expect("a dataset that packs documents says where they start");
                let mut next = starts.iter().peekable();
                let mut id = 0;
                for t in 0..seq_len as u32 {
                    while next.next_if(|&&s| s <= t).is_some() {
                        id += 1;
                    }
                    segments.push(id);
                }
            }
        }
        Self { index, batch_size, seq_len, tokens, segments: packed.then_some(segments) }
    }

    /// The `seq_len + 1` tokens of row `b`.
    pub fn row(&self, b: usize) -> &[u32] {
        &self.tokens[b * (self.seq_len + 1)..][..self.seq_len + 1]
    }

    /// The `(B, T)` inputs, row-major: tokens `0..T` of each row.
    pub fn inputs(&self) -> Vec<u32> {
        self.tokens.chunks_exact(self.seq_len + 1).flat_map(|row| &row[..self.seq_len]).copied().collect()
    }

    /// The `(B, T)` targets, row-major: tokens `1..T+1` of each row.
    pub fn targets(&self) -> Vec<u32> {
        self.tokens.chunks_exact(self.seq_len + 1).flat_map(|row| &row[1..]).copied().collect()
    }

    /// With packed documents, `(B, T)`: each input token's position inside its document
    /// (0 at a document's first token, and at a row's first token: nothing before it is seen).
    pub fn positions(&self) -> Option<Vec<u32>> {
        let segments = self.segments.as_ref()?;
        let mut positions = Vec::with_capacity(segments.len());
        for row in segments.chunks_exact(self.seq_len) {
            let mut start = 0;
            for (t, &id) in row.iter().enumerate() {
                if t > 0 && id != row[t - 1] {
                    start = t;
                }
                positions.push((t - start) as u32);
            }
        }
        Some(positions)
    }

    /// Bytes of token data held: `B·(T+1)·4`, plus `B·T·4` of segment ids with packed documents.
    pub fn size_bytes(&self) -> u64 {
        ((self.tokens.len() + self.segments.as_ref().map_or(0, Vec::len)) * size_of::<u32>()) as u64
    }
}

/// The earliest failed batch: `next()` reports it on reaching it, and on every later call.
#[derive(Debug, Clone)]
struct Failure {
    worker: Option<usize>,
    batch: u64,
    message: String,
}

impl Failure {
    fn to_error(&self) -> DataError {
        DataError::WorkerPanicked { worker: self.worker, batch: self.batch, message: self.message.clone() }
    }
}

#[derive(Debug)]
struct State {
    /// Finished batches by index; all in `[next, next + capacity)`.
    ready: BTreeMap<u64, Batch>,
    /// The index the consumer takes next.
    next: u64,
    stop: bool,
    failure: Option<Failure>,
    /// Test hook ([`Loader::stall_at`]): the worker due to build this batch never does.
    stall_at: Option<u64>,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    /// Signalled when the consumer takes a batch (workers wait on it) or on stop.
    space: Condvar,
    /// Signalled when a batch or a failure arrives (the consumer waits on it).
    filled: Condvar,
    queued_bytes: Arc<AtomicU64>,
    /// Most finished batches the queue may hold.
    capacity: u64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Batches are built outside the lock, so a poisoned lock still holds consistent state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What a worker builds batches from.
struct Job {
    dataset: Arc<dyn Dataset>,
    split: Split,
    batch_size: usize,
    seq_len: usize,
    share: Share,
}

impl Job {
    fn build(&self, index: u64) -> Batch {
        Batch::build_share(&*self.dataset, self.split, index, self.batch_size, self.seq_len, self.share)
    }
}

/// How often a [`Loader::next`] waiting for a batch looks at its stop flag.
pub const STOP_POLL: Duration = Duration::from_millis(100);

/// How long dropping a loader waits for its workers to finish the batches they are building.
pub const JOIN_GRACE: Duration = Duration::from_secs(1);

/// An infinite, ordered stream of batches of one split, built synchronously or by workers.
pub struct Loader {
    job: Arc<Job>,
    position: u64,
    /// Set from outside (a signal) to end a wait for a batch ([`Loader::watch`]).
    stop: Option<Arc<AtomicBool>>,
    /// Test hook ([`Loader::stall_at`]) for the synchronous loader.
    stall_at: Option<u64>,
    num_workers: usize,
    prefetch_factor: usize,
    queued_bytes: Arc<AtomicU64>,
    shared: Option<Arc<Shared>>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("split", &self.job.split)
            .field("batch_size", &self.job.batch_size)
            .field("seq_len", &self.job.seq_len)
            .field("position", &self.position)
            .field("num_workers", &self.num_workers)
            .field("prefetch_factor", &self.prefetch_factor)
            .finish()
    }
}

impl Loader {
    /// A loader of `split` starting at batch `start_batch`. `num_workers = 0` builds each batch
    /// in [`next`](Self::next); otherwise `num_workers` threads build ahead, holding at most
    /// `num_workers · prefetch_factor` finished batches.
    pub fn new(
        dataset: Arc<dyn Dataset>,
        split: Split,
        batch_size: usize,
        seq_len: usize,
        start_batch: u64,
        num_workers: usize,
        prefetch_factor: usize,
    ) -> Result<Self, DataError> {
        Self::new_shared(dataset, split, batch_size, seq_len, start_batch, num_workers, prefetch_factor, Share::WHOLE)
    }

    /// [`new`](Self::new) for one rank's [`Share`] of each batch.
    #[allow(clippy::too_many_arguments)]
    pub fn new_shared(
        dataset: Arc<dyn Dataset>,
        split: Split,
        batch_size: usize,
        seq_len: usize,
        start_batch: u64,
        num_workers: usize,
        prefetch_factor: usize,
        share: Share,
    ) -> Result<Self, DataError> {
        let invalid =
            |key, value: usize, reason: String| DataError::InvalidOption { key, value: value.to_string(), reason };
        if batch_size == 0 {
            return Err(invalid("train.batch_size", 0, "must be at least 1".into()));
        }
        if seq_len == 0 {
            return Err(invalid("data.seq_len", 0, "must be at least 1".into()));
        }
        if let Some(max) = dataset.max_seq_len(split).filter(|&max| seq_len > max) {
            return Err(invalid(
                "data.seq_len",
                seq_len,
                format!("the {split} split of {} supports at most {max}", dataset.describe()),
            ));
        }
        if num_workers > 0 && prefetch_factor == 0 {
            return Err(invalid(
                "data.prefetch_factor",
                0,
                "must be at least 1 when data.num_workers > 0 (batches queued per worker)".into(),
            ));
        }
        check_start(start_batch, batch_size, num_workers, prefetch_factor, share)?;
        let job = Arc::new(Job { dataset, split, batch_size, seq_len, share });
        let queued_bytes = Arc::new(AtomicU64::new(0));
        let mut loader = Self {
            job,
            position: start_batch,
            stop: None,
            stall_at: None,
            num_workers,
            prefetch_factor,
            queued_bytes: queued_bytes.clone(),
            shared: None,
            workers: Vec::with_capacity(num_workers),
        };
        if num_workers == 0 {
            return Ok(loader);
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                ready: BTreeMap::new(),
                next: start_batch,
                stop: false,
                failure: None,
                stall_at: None,
            }),
            space: Condvar::new(),
            filled: Condvar::new(),
            queued_bytes,
            capacity: (num_workers * prefetch_factor) as u64,
        });
        loader.shared = Some(shared.clone());
        for worker in 0..num_workers {
            let (shared, job) = (shared.clone(), loader.job.clone());
            let handle = thread::Builder::new()
                .name(format!("ava-data-{worker}"))
                .spawn(move || work(&shared, &job, worker, num_workers, start_batch + worker as u64))
                // Dropping `loader` stops and joins the workers already started.
                .map_err(|source| DataError::Spawn { source })?;
            loader.workers.push(handle);
        }
        Ok(loader)
    }

    /// From now on a [`next`](Self::next) waiting for a batch that is not ready gives up with
    /// [`DataError::Stopped`] within [`STOP_POLL`] of `stop` being set (e.g. by a signal
    /// handler); the position stays at the batch waited for.
    pub fn watch(&mut self, stop: Arc<AtomicBool>) {
        self.stop = Some(stop);
    }

    /// Test hook: batch `batch` is never built, as if reading its data hung on a dead disk:
    /// the worker due to build it blocks for good (without workers, [`next`](Self::next)
    /// blocks), so the consumer's wait for it ends only through [`watch`](Self::watch)'s flag.
    #[doc(hidden)]
    pub fn stall_at(&mut self, batch: u64) {
        self.stall_at = Some(batch);
        if let Some(shared) = &self.shared {
            shared.lock().stall_at = Some(batch);
        }
    }

    /// The next batch (the stream never ends). Errors on reaching a batch whose building
    /// panicked, and on every later call; with a stop flag set, [`DataError::Stopped`] instead
    /// of waiting on for a batch that is not ready.
    #[allow(clippy::should_implement_trait)] // a fallible, infinite stream: `Option` would only add noise
    pub fn next(&mut self) -> Result<Batch, DataError> {
        let batch = match &self.shared {
            None => self.build_here()?,
            Some(shared) => self.take_ready(shared)?,
        };
        self.position += 1;
        Ok(batch)
    }

    /// Whether the stop flag is set.
    fn stopping(&self) -> bool {
        self.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst))
    }

    /// The stopped outcome of a wait for the batch at `position` that began at `since`.
    fn stopped(&self, since: Instant) -> DataError {
        let waited_ms = u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX);
        DataError::Stopped { split: self.job.split, batch: self.position, waited_ms }
    }

    /// Without workers: builds the batch at `position` on this thread.
    fn build_here(&self) -> Result<Batch, DataError> {
        let (job, index) = (&*self.job, self.position);
        if self.stall_at == Some(index) {
            // The hook's hung read: only the stop flag ends it.
            let since = Instant::now();
            loop {
                if self.stopping() {
                    return Err(self.stopped(since));
                }
                thread::sleep(STOP_POLL);
            }
        }
        panic::catch_unwind(AssertUnwindSafe(|| job.build(index))).map_err(|payload| DataError::WorkerPanicked {
            worker: None,
            batch: index,
            message: panic_message(&*payload),
        })
    }

    /// With workers: waits for the batch at `position`, in slices of [`STOP_POLL`] so that a
    /// stop flag set meanwhile is seen.
    fn take_ready(&self, shared: &Shared) -> Result<Batch, DataError> {
        let since = Instant::now();
        let mut state = shared.lock();
        loop {
            // The hook's batch is never delivered, even when built before the hook was set.
            if state.stall_at != Some(self.position)
                && let Some(batch) = state.ready.remove(&self.position)
            {
                state.next += 1;
                shared.queued_bytes.fetch_sub(batch.size_bytes(), Ordering::SeqCst);
                drop(state);
                shared.space.notify_all();
                return Ok(batch);
            }
            // Batches before the failed one are still delivered, in order.
            if let Some(failure) = state.failure.as_ref().filter(|f| f.batch <= self.position) {
                return Err(failure.to_error());
            }
            if self.stopping() {
                return Err(self.stopped(since));
            }
            state = shared.filled.wait_timeout(state, STOP_POLL).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    /// Index of the batch the next [`next`](Self::next) returns: what a checkpoint saves to
    /// resume the stream.
    pub fn position(&self) -> u64 {
        self.position
    }

    /// Bytes of finished batches currently waiting in the queue.
    pub fn queued_bytes(&self) -> u64 {
        self.queued_bytes.load(Ordering::SeqCst)
    }

    /// A shared handle on [`queued_bytes`](Self::queued_bytes), for memory reporting from other
    /// threads; it reads 0 once the loader is dropped.
    pub fn queued_bytes_handle(&self) -> Arc<AtomicU64> {
        self.queued_bytes.clone()
    }

    /// The most bytes the queue can hold: `W · prefetch_factor · B · (T+1) · 4`, `(2T+1)`
    /// with packed documents' segment ids (0 without workers). Batches being built or held by
    /// the consumer come on top.
    pub fn capacity_bytes(&self) -> u64 {
        let per_row = self.job.seq_len + 1 + if self.job.dataset.packs_documents() { self.job.seq_len } else { 0 };
        let batch = (self.job.batch_size * per_row * size_of::<u32>()) as u64;
        (self.num_workers * self.prefetch_factor) as u64 * batch
    }

    /// The split this loader reads.
    pub fn split(&self) -> Split {
        self.job.split
    }

    /// Sequences per batch.
    pub fn batch_size(&self) -> usize {
        self.job.batch_size
    }

    /// Tokens per input row.
    pub fn seq_len(&self) -> usize {
        self.job.seq_len
    }

    /// Number of worker threads (0 = synchronous).
    pub fn num_workers(&self) -> usize {
        self.num_workers
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        if let Some(shared) = &self.shared {
            let mut state = shared.lock();
            state.stop = true;
            state.ready.clear();
            shared.queued_bytes.store(0, Ordering::SeqCst);
            drop(state);
            shared.space.notify_all();
            shared.filled.notify_all();
        }
        // A worker finishes at most the batch it is building, then sees `stop`; one still
        // building after JOIN_GRACE (a read that hangs) is left behind rather than waited for.
        let deadline = Instant::now() + JOIN_GRACE;
        while self.workers.iter().any(|h| !h.is_finished()) && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        for handle in self.workers.drain(..) {
            if handle.is_finished() {
                let _ = handle.join();
            }
        }
    }
}

/// Worker `worker` of `stride`: builds batches `first, first + stride, ...` until stopped.
fn work(shared: &Shared, job: &Job, worker: usize, stride: usize, first: u64) {
    let mut index = first;
    loop {
        {
            let mut state = shared.lock();
            // Wait until the batch fits the window; stop on drop, or once past a failed batch
            // (the stream ends there; earlier batches are still wanted).
            loop {
                if state.stop || state.failure.as_ref().is_some_and(|f| index > f.batch) {
                    return;
                }
                // Saturating: a window reaching past u64::MAX holds every later index.
                if index < state.next.saturating_add(shared.capacity) {
                    break;
                }
                state = shared.space.wait(state).unwrap_or_else(PoisonError::into_inner);
            }
            if state.stall_at == Some(index) {
                drop(state);
                // The hook's hung read: it never returns, whatever the loader does.
                loop {
                    thread::park();
                }
            }
        }
        let built = panic::catch_unwind(AssertUnwindSafe(|| job.build(index)));
        let mut state = shared.lock();
        if state.stop {
            return;
        }
        match built {
            Ok(batch) => {
                shared.queued_bytes.fetch_add(batch.size_bytes(), Ordering::SeqCst);
                state.ready.insert(index, batch);
            }
            Err(payload) => {
                let message = panic_message(&*payload);
                // Keep the earliest failed batch: the stream ends there.
                if state.failure.as_ref().is_none_or(|f| index < f.batch) {
                    state.failure = Some(Failure { worker: Some(worker), batch: index, message });
                }
            }
        }
        let failed = state.failure.is_some();
        drop(state);
        shared.filled.notify_all();
        if failed {
            // Wake the workers waiting for room, so those past the failure exit.
            shared.space.notify_all();
        }
        // Past the last index there is nothing more to build.
        let Some(following) = index.checked_add(stride as u64) else { return };
        index = following;
    }
}

/// Checks that every sequence index the loader can reach from `start_batch` (its batches,
/// the workers' read-ahead, every rank's rows) fits in 64 bits. A start past that (a damaged
/// or crafted checkpoint position) is refused here, before any worker starts.
fn check_start(
    start_batch: u64,
    batch_size: usize,
    num_workers: usize,
    prefetch_factor: usize,
    share: Share,
) -> Result<(), DataError> {
    let ahead = (num_workers as u64).saturating_mul(prefetch_factor as u64 + 1).saturating_add(1);
    let fits = start_batch
        .checked_add(ahead)
        .and_then(|end| end.checked_mul(share.world as u64))
        .and_then(|rows| rows.checked_mul(batch_size as u64));
    match fits {
        Some(_) => Ok(()),
        None => Err(DataError::InvalidOption {
            key: "the loader's start batch",
            value: start_batch.to_string(),
            reason: format!(
                "past the last batch whose sequences have a 64-bit index (batches of {batch_size} sequences × {} \
                 ranks); a saved position this large is damaged",
                share.world
            ),
        }),
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    ava_core::ffi::panic_message(payload).unwrap_or_else(|| "(no message)".to_string())
}

#[cfg(test)]
mod stop_tests {
    use super::*;
    use crate::{DataOptions, MarkovSpec, Packing, Source, open};

    fn synthetic() -> Arc<dyn Dataset> {
        let options = DataOptions {
            source: Source::Synthetic(MarkovSpec::default()),
            seq_len: 16,
            val_fraction: 0.1,
            seed: 4,
            packing: Packing::Concat,
        };
        open(&options).unwrap()
    }

    /// A loader of 2 sequences of 16 tokens whose batch 3 never comes, watching `flag`.
    fn stalled(workers: usize, flag: &Arc<AtomicBool>) -> Loader {
        let mut loader = Loader::new(synthetic(), Split::Train, 2, 16, 0, workers, 2).unwrap();
        loader.stall_at(3);
        loader.watch(flag.clone());
        loader
    }

    #[track_caller]
    fn assert_stopped(result: Result<Batch, DataError>) {
        match result {
            Err(e @ DataError::Stopped { split: Split::Train, batch: 3, .. }) => {
                let text = e.to_string();
                assert!(text.starts_with("stopped while waiting for the data loader: batch 3 of the train split"));
            }
            other => panic!("expected the stopped outcome, got {other:?}"),
        }
    }

    #[test]
    fn a_blocked_next_returns_the_stopped_outcome_once_the_flag_is_set() {
        for workers in [0, 1, 3] {
            let flag = Arc::new(AtomicBool::new(false));
            let mut loader = stalled(workers, &flag);
            for i in 0..3 {
                assert_eq!(loader.next().unwrap().index, i, "batches before the stall come, {workers} workers");
            }
            // Set from another thread while `next` is blocked on batch 3.
            let setter = {
                let flag = flag.clone();
                thread::spawn(move || {
                    thread::sleep(STOP_POLL * 3);
                    flag.store(true, Ordering::SeqCst);
                })
            };
            assert_stopped(loader.next());
            setter.join().unwrap();
            assert_eq!(loader.position(), 3, "the batch waited for is still the next one");
            // Asked again with the flag still set: the same answer, at once.
            assert_stopped(loader.next());
            // Dropping it leaves the hung worker behind instead of waiting for it forever.
            drop(loader);
        }
    }

    #[test]
    fn a_ready_batch_is_delivered_even_with_the_flag_set() {
        let flag = Arc::new(AtomicBool::new(true));
        let mut loader = stalled(2, &flag);
        // Batch 0 may not be built yet when asked: the flag ends the wait, or it comes.
        match loader.next() {
            Ok(b) => assert_eq!(b.index, 0),
            Err(e) => assert!(matches!(e, DataError::Stopped { batch: 0, .. }), "{e}"),
        }
        let mut sync = stalled(0, &flag);
        assert_eq!(sync.next().unwrap().index, 0, "building here is not a wait");
    }

    #[test]
    fn a_window_past_the_last_index_ends_in_an_error_not_a_hang() {
        let flag = Arc::new(AtomicBool::new(false));
        let Ok(mut loader) = Loader::new(synthetic(), Split::Train, 2, 16, u64::MAX - 1, 2, 4) else {
            return; // refused when built: no hang either
        };
        loader.watch(flag.clone());
        let setter = thread::spawn(move || {
            // Only if the loader hangs: the test then fails on the stopped outcome.
            thread::sleep(Duration::from_secs(20));
            flag.store(true, Ordering::SeqCst);
        });
        let result = loader.next();
        assert!(
            !matches!(result, Err(DataError::Stopped { .. })),
            "the loader hung on a start near u64::MAX: {result:?}"
        );
        drop(setter); // detached; it only sets a flag nobody reads any more
    }
}
