//! A test hook for the promise that a full disk during `prepare` stops with what to do, the
//! shards already complete stay usable, and the next run continues. A real full disk cannot
//! be made on demand in a test, so [`prepare_with_fault`](super::prepare_with_fault) takes a
//! [`DiskFault`]: one file of the corpus (a shard, or one save of the manifest) gets only so
//! many bytes onto the disk before its writes fail with `StorageFull` (ENOSPC), leaving the
//! partly written temporary file a real full disk leaves. `prepare` itself passes none, and
//! then every file has room for `u64::MAX` bytes.

/// Where a simulated disk fills up: after `after` bytes of one file reached it.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskFault {
    /// While writing shard `index` (the number in its file name, counted over every run).
    Shard {
        /// The shard.
        index: usize,
        /// Bytes of its file written before the disk is full.
        after: u64,
    },
    /// While saving the manifest for the `save`-th time in this run (from 0): save `n` lists
    /// this run's `n`-th shard; the one after the last shard's marks the corpus complete.
    Manifest {
        /// The save.
        save: usize,
        /// Bytes of `manifest.json.tmp` written before the disk is full.
        after: u64,
    },
}

impl DiskFault {
    /// Room on the disk for shard `index`.
    pub(crate) fn shard_room(fault: Option<Self>, index: usize) -> u64 {
        match fault {
            Some(DiskFault::Shard { index: i, after }) if i == index => after,
            _ => u64::MAX,
        }
    }

    /// Room on the disk for this run's `save`-th manifest save.
    pub(crate) fn manifest_room(fault: Option<Self>, save: usize) -> u64 {
        match fault {
            Some(DiskFault::Manifest { save: s, after }) if s == save => after,
            _ => u64::MAX,
        }
    }
}
