//! The tier end to end: round trips in both I/O modes and through each path (a write still
//! in flight, a prefetched read, a read on the caller's thread), damage of every kind named
//! with its file, a full disk, back-pressure and the options.

use std::path::Path;

use ava_core::{DType, ErrorKind, HostContext, OffloadTier};

use super::*;

fn tier(path: &Path, extra: &str) -> Result<NvmeTier, PluginError> {
    let json = format!(r#"{{"path": {:?}{extra}}}"#, path.to_str().unwrap());
    ava_core::ffi::build::<NvmeTier>(&json, &HostContext::default())
}

fn bytes(n: usize, salt: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt)).collect()
}

/// The sizes the issue names: 1, 511, 4096, 4097 bytes, one block of the disk plus one, and
/// the sizes around a record's header filling its first block exactly.
const SIZES: [usize; 7] = [1, 511, 4096, 4097, 4096 * 3 + 1, 4096 - 128, 4096 - 127];

fn round_trips(t: &NvmeTier) {
    for (i, &n) in SIZES.iter().enumerate() {
        let key = format!("opt/model.layers.{i}.w/exp_avg");
        let data = bytes(n, i as u8);
        t.put(&key, &data, DType::U8).unwrap();
        // Still in flight, or written: the same bytes.
        let mut back = vec![0; n];
        t.get(&key, &mut back).unwrap();
        assert_eq!(back, data, "{n} bytes, before the write finished");
        t.flush().unwrap();
        let mut back = vec![0; n];
        t.get(&key, &mut back).unwrap();
        assert_eq!(back, data, "{n} bytes, read on the caller's thread");
        t.prefetch(&key).unwrap();
        let mut back = vec![0; n];
        t.get(&key, &mut back).unwrap();
        assert_eq!(back, data, "{n} bytes, prefetched");
        assert_eq!(t.len(&key).unwrap(), Some(n as u64));
        let on_disk = std::fs::metadata(t.file_of(&key).unwrap()).unwrap().len();
        assert_eq!(on_disk % 4096, 0, "records are whole 4 KiB blocks");
    }
    assert_eq!(t.resident_bytes(), 0, "nothing held once written and read");
}

#[test]
fn round_trip_with_direct_io_off() {
    let dir = tempfile::tempdir().unwrap();
    let t = tier(dir.path(), r#", "direct_io": "off""#).unwrap();
    assert!(!t.direct().unwrap());
    assert!(t.describe().contains("buffered I/O (direct_io: off)"), "{}", t.describe());
    round_trips(&t);
}

#[test]
fn round_trip_with_direct_io_on() {
    let dir = tempfile::tempdir().unwrap();
    if let Err(e) = disk::probe_direct(dir.path()) {
        eprintln!("SKIPPED: the filesystem of {} refuses O_DIRECT ({e})", dir.path().display());
        return;
    }
    let t = tier(dir.path(), r#", "direct_io": "on""#).unwrap();
    assert!(t.direct().unwrap());
    assert!(t.describe().contains("direct I/O (O_DIRECT"), "{}", t.describe());
    round_trips(&t);
}

/// Replacing and evicting records keeps the count right and never serves an old record.
#[test]
fn replace_evict_and_accounting() {
    let dir = tempfile::tempdir().unwrap();
    let t = tier(dir.path(), "").unwrap();
    t.put("a", &bytes(10, 1), DType::F32).unwrap();
    t.put("a", &bytes(5000, 2), DType::F32).unwrap();
    t.put("b", &bytes(3, 3), DType::U8).unwrap();
    t.flush().unwrap();
    assert_eq!(t.used_bytes(), 2 * 4096 + 4096);
    let mut back = vec![0; 5000];
    t.get("a", &mut back).unwrap();
    assert_eq!(back, bytes(5000, 2));
    let e = t.get("a", &mut [0; 10]).unwrap_err();
    assert_eq!(e.message.as_str(), "nvme tier: record 'a' has 5000 bytes, the buffer to read it into has 10");
    t.prefetch("b").unwrap();
    t.evict("b").unwrap();
    t.evict("never").unwrap();
    assert_eq!((t.used_bytes(), t.len("b").unwrap()), (2 * 4096, None));
    assert!(!t.file_of("b").unwrap().exists());
    let e = t.get("b", &mut [0; 3]).unwrap_err();
    assert_eq!(e.message.as_str(), "nvme tier: no record under key 'b'");
    assert!(t.capacity() > t.used_bytes());
    assert_eq!(t.resident_bytes(), 0);
}

fn damaged(edit: impl Fn(&Path), expect: &str) {
    let dir = tempfile::tempdir().unwrap();
    let t = tier(dir.path(), "").unwrap();
    t.put("opt/w/exp_avg", &bytes(9000, 7), DType::F32).unwrap();
    t.flush().unwrap();
    let file = t.file_of("opt/w/exp_avg").unwrap();
    edit(&file);
    for prefetched in [false, true] {
        if prefetched {
            t.prefetch("opt/w/exp_avg").unwrap();
        }
        let e = t.get("opt/w/exp_avg", &mut [0; 9000]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Io);
        let m = e.message.as_str();
        assert!(m.starts_with(&format!("nvme tier: {}: ", file.display())), "names the file: {m}");
        assert!(m.contains(expect), "{m}");
    }
}

#[test]
fn a_corrupted_byte_is_detected() {
    damaged(
        |f| {
            let mut b = std::fs::read(f).unwrap();
            b[5000] ^= 0x40;
            std::fs::write(f, b).unwrap();
        },
        "the data is corrupt: CRC-32",
    );
}

#[test]
fn a_truncated_file_is_detected() {
    damaged(
        |f| {
            let file = std::fs::OpenOptions::new().write(true).open(f).unwrap();
            file.set_len(4096).unwrap();
        },
        "truncated: the file has 4096 bytes, the record needs 12288",
    );
}

#[test]
fn a_stale_file_from_another_run_is_detected() {
    let dir = tempfile::tempdir().unwrap();
    let other = tier(dir.path(), "").unwrap();
    other.put("opt/w/exp_avg", &bytes(9000, 8), DType::F32).unwrap();
    other.flush().unwrap();
    let from = other.file_of("opt/w/exp_avg").unwrap();
    damaged(|f| std::fs::copy(&from, f).map(drop).unwrap(), "a stale file written by another run");
}

#[test]
fn an_older_record_of_the_key_is_detected() {
    let dir = tempfile::tempdir().unwrap();
    let t = tier(dir.path(), "").unwrap();
    t.put("k", &bytes(100, 1), DType::U8).unwrap();
    t.flush().unwrap();
    let old = std::fs::read(t.file_of("k").unwrap()).unwrap();
    t.put("k", &bytes(100, 2), DType::U8).unwrap();
    t.flush().unwrap();
    // As if the second write had never reached the disk.
    std::fs::write(t.file_of("k").unwrap(), old).unwrap();
    let e = t.get("k", &mut [0; 100]).unwrap_err();
    assert!(e.message.contains("a stale record: write #1 of the key, but #2 was the last"), "{}", e.message);
}

/// Runs given the same path write in different directories; each one's files go with it.
#[test]
fn two_runs_on_one_path_never_share_files() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (tier(dir.path(), "").unwrap(), tier(dir.path(), "").unwrap());
    a.put("k", &bytes(10, 1), DType::U8).unwrap();
    b.put("k", &bytes(10, 2), DType::U8).unwrap();
    a.flush().unwrap();
    b.flush().unwrap();
    assert_ne!(a.file_of("k").unwrap(), b.file_of("k").unwrap());
    let (mut x, mut y) = ([0; 10], [0; 10]);
    a.get("k", &mut x).unwrap();
    b.get("k", &mut y).unwrap();
    assert_eq!((x.to_vec(), y.to_vec()), (bytes(10, 1), bytes(10, 2)));
    let a_dir = a.dir().unwrap().to_path_buf();
    drop(a);
    assert!(!a_dir.exists() && b.dir().unwrap().exists());
}

/// Writes beyond `max_in_flight` wait, so the memory the tier holds stays bounded.
#[test]
fn writes_in_flight_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let t = tier(dir.path(), r#", "max_in_flight": "64KiB", "io_threads": 1"#).unwrap();
    let mut most = 0;
    for i in 0..64 {
        t.put(&format!("k{i}"), &bytes(20_000, i as u8), DType::U8).unwrap();
        most = most.max(t.resident_bytes());
    }
    t.flush().unwrap();
    assert!(most <= 64 << 10, "{most} bytes held");
    for i in 0..64 {
        let mut back = vec![0; 20_000];
        t.get(&format!("k{i}"), &mut back).unwrap();
        assert_eq!(back, bytes(20_000, i as u8));
    }
}

#[test]
fn puts_and_gets_from_many_threads() {
    let dir = tempfile::tempdir().unwrap();
    let t = tier(dir.path(), r#", "io_threads": 3"#).unwrap();
    std::thread::scope(|s| {
        for th in 0..4u8 {
            let t = &t;
            s.spawn(move || {
                for round in 0..5u8 {
                    for i in 0..10 {
                        let key = format!("{th}/{i}");
                        let data = bytes(3000 + i, th ^ round);
                        t.put(&key, &data, DType::U8).unwrap();
                        t.prefetch(&key).unwrap();
                        let mut back = vec![0; data.len()];
                        t.get(&key, &mut back).unwrap();
                        assert_eq!(back, data);
                    }
                }
            });
        }
    });
    t.flush().unwrap();
    assert_eq!(t.used_bytes(), 40 * 4096);
}

#[test]
fn preflight_checks_the_free_space() {
    let dir = tempfile::tempdir().unwrap();
    let t = tier(dir.path(), r#", "capacity": "1MiB""#).unwrap();
    t.preflight(&[100_000, 200_000]).unwrap();
    let e = t.preflight(&[1 << 20]).unwrap_err();
    assert_eq!(e.kind, ErrorKind::OutOfMemory);
    assert!(e.message.contains("the plan offloads 1 records taking 1.00 MiB"), "{}", e.message);
    assert!(e.message.contains("its capacity option leaves only 1.00 MiB free"), "{}", e.message);
    let free = disk::free_space(dir.path()).unwrap();
    let t = tier(dir.path(), "").unwrap();
    let e = t.preflight(&[free, free]).unwrap_err();
    assert!(e.message.contains(&format!("{} has only", dir.path().display())), "{}", e.message);
}

#[test]
fn options_are_checked() {
    let e = ava_core::ffi::build::<NvmeTier>(
        r#"{"direct_io": "sometimes", "io_threads": 0, "capacity": 0}"#,
        &HostContext::default(),
    )
    .unwrap_err();
    assert_eq!(
        e.details().collect::<Vec<_>>(),
        [
            "option 'path' is required: the directory on the fast disk, e.g. {name: nvme, path: /mnt/nvme/ava}",
            "option 'direct_io': expected auto, on or off, got 'sometimes'",
            "option 'io_threads': expected 1 to 64 threads, got 0",
            "option 'capacity': 0 bytes holds nothing; leave it unset for the disk's free space",
        ]
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("file"), b"").unwrap();
    let e = tier(&dir.path().join("file/sub"), "").unwrap_err();
    assert_eq!(
        e.details().collect::<Vec<_>>(),
        [format!("option 'path': {} is not a directory", dir.path().join("file").display())]
    );
}

/// Building the tier (as validating a config does) leaves nothing on the disk; the first
/// use makes the run's directory, and a path it cannot make is an error then.
#[test]
fn nothing_is_made_until_first_use() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("new/deeper");
    let t = tier(&path, "").unwrap();
    assert!(!path.exists());
    assert_eq!((t.used_bytes(), t.len("k").unwrap()), (0, None));
    t.evict("k").unwrap();
    t.flush().unwrap();
    assert!(!path.exists(), "reads of an unused tier start nothing");
    t.put("k", &[1], DType::U8).unwrap();
    assert!(t.dir().unwrap().starts_with(&path));

    let blocked = dir.path().join("blocked");
    let t = tier(&blocked.join("x"), "").unwrap();
    std::fs::write(&blocked, b"now a file").unwrap();
    let e = t.put("k", &[1], DType::U8).unwrap_err();
    assert!(
        e.message.contains(&format!("cannot make a run directory in {}", blocked.join("x").display())),
        "{}",
        e.message
    );
}

#[test]
fn a_full_disk_is_an_error_and_never_taken_for_success() {
    let Some(disk) = ava_tests::SmallDisk::mount("256k") else { return };
    let t = tier(disk.path(), "").unwrap();
    let mut failed = None;
    for i in 0..100 {
        if let Err(e) = t.put(&format!("k{i}"), &bytes(20_000, i as u8), DType::U8).and_then(|()| t.flush()) {
            failed = Some((i, e));
            break;
        }
    }
    let (i, e) = failed.expect("a 256 KiB disk cannot hold 100 records of 20 kB");
    assert_eq!(e.kind, ErrorKind::OutOfMemory, "{}", e.message);
    assert!(e.message.contains("no space left on the device"), "{}", e.message);
    assert!(e.message.contains(&format!("k{i}.")), "names the file: {}", e.message);
    // The record whose write failed is refused, not served from a partial file...
    let err = t.get(&format!("k{i}"), &mut vec![0; 20_000]).unwrap_err();
    assert!(err.message.contains("no space left") || err.message.contains("truncated"), "{}", err.message);
    // ... and the ones written before it are intact.
    for j in 0..i {
        let mut back = vec![0; 20_000];
        t.get(&format!("k{j}"), &mut back).unwrap();
        assert_eq!(back, bytes(20_000, j as u8));
    }
    // The preflight would have said so.
    let e = t.preflight(&[1 << 20]).unwrap_err();
    assert!(e.message.contains("has only"), "{}", e.message);
}

/// In a shared path a user's records are theirs alone: the record files are 0600, in 0700
/// directories.
#[test]
fn records_are_readable_by_their_user_alone() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let t = tier(dir.path(), r#", "direct_io": "off""#).unwrap();
    t.put("k", &bytes(100, 1), DType::U8).unwrap();
    t.flush().unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(&t.file_of("k").unwrap()), 0o600);
    assert_eq!(mode(t.dir().unwrap()), 0o700);
    assert_eq!(mode(t.dir().unwrap().parent().unwrap()), 0o700);
}
