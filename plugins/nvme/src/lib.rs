//! # NVMe offload as an Ava plugin
//!
//! An [`OffloadTier`](ava_core::OffloadTier) that keeps records in files on a fast disk, in
//! the spirit of DeepSpeed's ZeRO-Infinity: the engine streams optimizer state through it
//! (each parameter's state put back after its step, the next ones prefetched while it
//! steps) and parks checkpointed block inputs in it between forward and backward.
//!
//! ```yaml
//! plugins:
//!   offload: {name: nvme, path: /mnt/nvme/ava, direct_io: auto, io_threads: 2}
//! offload:
//!   tiers: [ram: 60%, nvme: 40%]   # 40% of the optimizer state streams from the disk
//! ```
//!
//! What it guarantees, each a problem users of other offload engines have reported:
//! - every record carries CRC-32s of its header and data, its key, its run's id and the
//!   sequence number of its write, all checked on read: a corrupt, truncated, misplaced,
//!   stale (an older write of the key) or foreign (another run's) file is an error naming
//!   the file, never data ([`record`]);
//! - a short write or a full disk is an error, never success ([`disk`]);
//! - each run writes in its own locked directory, so two runs given the same path never
//!   share files, in a private (0700) directory per user, so a path shared by several users
//!   leaks nothing and no user can block or break another's run; directories of dead runs are
//!   removed ([`namespace`]);
//! - `O_DIRECT` with 4 KiB-aligned buffers, offsets and lengths where the filesystem takes
//!   it, with `direct_io: auto` falling back to buffered I/O and saying so (the run's log
//!   shows [`describe`](ava_core::OffloadTier::describe));
//! - writes go out and prefetched reads come in on `io_threads` background threads, which
//!   wait on the disk, not the CPU, so they do not compete with the host's compute threads
//!   ([`tier`]);
//! - [`preflight`](ava_core::OffloadTier::preflight) checks the disk has the room the plan
//!   needs before training starts;
//! - building the tier only checks its options (a `path` that is a file, or whose nearest
//!   existing directory is not writable, is refused then); the directory, the probe and the
//!   threads start at first use, so `ava config validate` leaves nothing on the disk.
//!
//! Its own buffers (writes in flight, prefetched reads) are host memory the host's allocator
//! does not see; the tier counts them in `resident_bytes`.

pub mod disk;
pub mod namespace;
pub mod record;
mod tier;

use ava_core::prelude::*;

pub use tier::{DirectIo, NvmeTier, Settings, check_path};

impl Plugin for NvmeTier {
    fn manifest() -> Manifest {
        Manifest::new(
            "nvme",
            PluginKind::Offload,
            env!("CARGO_PKG_VERSION"),
            "offload to a fast disk: checksummed records in a per-run directory, O_DIRECT, background writes and prefetch",
        )
        .option(OptionSpec::optional(
            "path",
            OptionType::String,
            "directory on the fast disk, which other users may share; the run writes in its own ava-<uid>/ava-run-<id> directory inside it (required)",
        ))
        .option(OptionSpec::string(
            "direct_io",
            "auto",
            "auto: O_DIRECT where the filesystem supports it, else buffered I/O (logged); on: O_DIRECT or an error; off: buffered",
        ))
        .option(OptionSpec::int("io_threads", 2, "background I/O threads (they wait on the disk, not the CPU)"))
        .option(OptionSpec::new(
            "max_in_flight",
            OptionType::Size,
            "\"64MiB\"",
            "most bytes of writes waiting for the disk (host memory); a put beyond it waits",
        ))
        .option(OptionSpec::optional(
            "capacity",
            OptionType::Size,
            "most bytes the tier may store; unset for the disk's free space",
        ))
    }

    fn from_options(mut options: Options) -> Result<Self, PluginError> {
        let path = options.opt_string("path");
        options.check(path.as_deref().is_some_and(|p| !p.trim().is_empty()), || {
            "option 'path' is required: the directory on the fast disk, e.g. {name: nvme, path: /mnt/nvme/ava}".into()
        });
        let direct_io = match options.opt_string("direct_io").as_deref() {
            Some("on") => DirectIo::On,
            Some("off") => DirectIo::Off,
            Some("auto") | None => DirectIo::Auto,
            Some(other) => {
                options.problem(format!("option 'direct_io': expected auto, on or off, got '{other}'"));
                DirectIo::Auto
            }
        };
        let io_threads = options.int("io_threads");
        options.check((1..=64).contains(&io_threads), || {
            format!("option 'io_threads': expected 1 to 64 threads, got {io_threads}")
        });
        let max_in_flight = options.opt_size("max_in_flight").unwrap_or(64 << 20);
        options.check(max_in_flight > 0, || "option 'max_in_flight': must be more than 0 bytes".into());
        let capacity = options.opt_size("capacity");
        options.check(capacity != Some(0), || {
            "option 'capacity': 0 bytes holds nothing; leave it unset for the disk's free space".into()
        });
        if let Some(Err(problem)) =
            path.as_deref().filter(|p| !p.trim().is_empty()).map(|p| tier::check_path(p.as_ref()))
        {
            options.problem(problem);
        }
        options.finish()?;
        Ok(NvmeTier::new(Settings {
            path: path.expect("checked above").into(),
            direct_io,
            io_threads: io_threads as usize,
            max_in_flight,
            capacity,
        }))
    }
}

ava_core::export_plugin!(offload: NvmeTier);

#[cfg(test)]
mod tests;
