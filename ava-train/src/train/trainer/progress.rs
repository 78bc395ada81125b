//! How a run tells its progress: a step's or an evaluation's work ([`WorkProgress`]) and a
//! checkpoint's save or load ([`IoProgress`], counted by the writers of its files).

use super::*;

/// How far a step or an evaluation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkProgress {
    /// A step's micro-batches, or an evaluation's batches.
    pub what: Work,
    /// Done so far.
    pub done: u64,
    /// In all.
    pub total: u64,
}

/// What [`WorkProgress`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// The micro-batches of this step (its forward and backward passes).
    Step(u64),
    /// The validation batches of the evaluation after this step.
    Evaluation(u64),
}

/// Receives [`WorkProgress`].
#[derive(Clone)]
pub struct WorkProgressFn(pub Arc<dyn Fn(&WorkProgress) + Send + Sync>);

impl std::fmt::Debug for WorkProgressFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WorkProgressFn")
    }
}

impl WorkProgressFn {
    /// Tells it, if there is one.
    pub(crate) fn tell(this: Option<&Self>, what: Work, done: u64, total: u64) {
        if let Some(f) = this {
            (f.0)(&WorkProgress { what, done, total });
        }
    }
}

/// How far writing or reading a checkpoint is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoProgress {
    /// `saving` or `loading`.
    pub what: &'static str,
    /// The checkpoint directory (for a save, where it will be).
    pub dir: PathBuf,
    /// Bytes done so far.
    pub done: u64,
    /// Bytes in all (weights and optimizer state; the small files are left out).
    pub total: u64,
}

/// Receives [`IoProgress`].
#[derive(Clone)]
pub struct IoProgressFn(pub Arc<dyn Fn(&IoProgress) + Send + Sync>);

impl std::fmt::Debug for IoProgressFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IoProgressFn")
    }
}

/// A checkpoint's save or load reports its progress every this many bytes.
pub const IO_PROGRESS_BYTES: u64 = 1 << 30;

/// Counts the bytes written through it (`done`, shared by the writers of one checkpoint) and
/// reports the count each time it passes a multiple of `every`.
pub(super) struct Counting<'a> {
    pub(super) out: &'a mut dyn Write,
    pub(super) done: &'a std::cell::Cell<u64>,
    pub(super) report: &'a dyn Fn(u64),
    pub(super) every: u64,
}

impl Write for Counting<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.out.write(buf)?;
        let before = self.done.get();
        self.done.set(before + n as u64);
        if (before + n as u64) / self.every > before / self.every {
            (self.report)(before + n as u64);
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

#[cfg(test)]
mod progress_tests {
    use std::io::Write;

    /// Two files written through one count: a report each time the total passes a multiple
    /// of the step, with the total then, and the bytes reach their file unchanged.
    #[test]
    fn counting_writers_report_each_step_of_the_total() {
        let reports = std::cell::RefCell::new(Vec::new());
        let report = |n: u64| reports.borrow_mut().push(n);
        let done = std::cell::Cell::new(0);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let mut first = super::Counting { out: &mut a, done: &done, report: &report, every: 10 };
        first.write_all(&[1; 7]).unwrap();
        first.write_all(&[2; 7]).unwrap();
        let mut second = super::Counting { out: &mut b, done: &done, report: &report, every: 10 };
        second.write_all(&[3; 25]).unwrap();
        assert_eq!(*reports.borrow(), vec![14, 39]);
        assert_eq!((a.len(), b.len(), done.get()), (14, 25, 39));
    }
}
