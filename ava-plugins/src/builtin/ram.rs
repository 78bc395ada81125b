//! The built-in offload tier `ram`: records kept in host memory, in a map behind a mutex.
//!
//! Useful to move optimizer state or checkpointed block inputs off an accelerator, and as the
//! reference tier the others are tested against. With `capacity` set, a `put` that would
//! exceed it is refused (and the earlier record under that key, if any, is kept), so the
//! engine can fall back instead of running the machine out of memory. A record lives in the
//! process's own memory, so it comes back exactly as stored; no checksum is needed.

use std::{
    collections::HashMap,
    sync::{Mutex, MutexGuard},
};

use ava_core::prelude::*;

/// The `ram` tier.
#[derive(Debug, Default)]
pub struct RamTier {
    /// Most bytes it may hold; `None` for no limit.
    capacity: Option<u64>,
    records: Mutex<Records>,
}

/// The records and their total size, under one lock so the two never disagree.
#[derive(Debug, Default)]
struct Records {
    map: HashMap<String, Vec<u8>>,
    used: u64,
}

impl RamTier {
    /// A tier holding at most `capacity` bytes (`None`: unlimited).
    pub fn new(capacity: Option<u64>) -> Self {
        Self { capacity, records: Mutex::default() }
    }

    fn records(&self) -> MutexGuard<'_, Records> {
        // Nothing panics while the lock is held with the map and `used` out of step, so a
        // poisoned lock still guards consistent data.
        self.records.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Plugin for RamTier {
    fn manifest() -> Manifest {
        Manifest::new(
            "ram",
            PluginKind::Offload,
            env!("CARGO_PKG_VERSION"),
            "offload to host RAM: records in an in-process map, optionally capped",
        )
        .option(OptionSpec::optional(
            "capacity",
            OptionType::Size,
            "most bytes the tier may hold (e.g. 16GiB); unset for no limit",
        ))
    }

    fn from_options(mut options: Options) -> Result<Self, PluginError> {
        let capacity = options.opt_size("capacity");
        options.check(capacity != Some(0), || {
            "option 'capacity': 0 bytes holds nothing; leave it unset for no limit".into()
        });
        options.finish()?;
        Ok(Self::new(capacity))
    }
}

impl OffloadTier for RamTier {
    fn capacity(&self) -> u64 {
        self.capacity.unwrap_or(u64::MAX)
    }

    fn used_bytes(&self) -> u64 {
        self.records().used
    }

    /// Every stored byte is in host memory.
    fn resident_bytes(&self) -> u64 {
        self.records().used
    }

    fn put(&self, key: &str, bytes: &[u8], _dtype: DType) -> Result<(), PluginError> {
        let mut records = self.records();
        let replaced = records.map.get(key).map_or(0, |r| r.len() as u64);
        let after = records.used - replaced + bytes.len() as u64;
        if let Some(cap) = self.capacity.filter(|&cap| after > cap) {
            return Err(PluginError::new(
                ErrorKind::OutOfMemory,
                format!(
                    "ram tier: cannot store {} bytes under key '{key}': {} of {cap} bytes in use{}",
                    bytes.len(),
                    records.used,
                    if replaced > 0 {
                        format!(" ({replaced} of them by the record it would replace)")
                    } else {
                        String::new()
                    }
                ),
            ));
        }
        records.map.insert(key.to_string(), bytes.to_vec());
        records.used = after;
        Ok(())
    }

    fn get(&self, key: &str, into: &mut [u8]) -> Result<(), PluginError> {
        let records = self.records();
        let record = records
            .map
            .get(key)
            .ok_or_else(|| PluginError::invalid_input(format!("ram tier: no record under key '{key}'")))?;
        if record.len() != into.len() {
            return Err(PluginError::invalid_input(format!(
                "ram tier: record '{key}' has {} bytes, the buffer to read it into has {}",
                record.len(),
                into.len()
            )));
        }
        into.copy_from_slice(record);
        Ok(())
    }

    fn len(&self, key: &str) -> Result<Option<u64>, PluginError> {
        Ok(self.records().map.get(key).map(|r| r.len() as u64))
    }

    // prefetch: the default no-op; the records already are in RAM.

    fn evict(&self, key: &str) -> Result<(), PluginError> {
        let mut records = self.records();
        if let Some(r) = records.map.remove(key) {
            records.used -= r.len() as u64;
        }
        Ok(())
    }
}

inventory::submit! { crate::builtin::Builtin::offload::<RamTier>() }

#[cfg(test)]
mod tests {
    use super::*;

    fn build(json: &str) -> Result<RamTier, PluginError> {
        ava_core::ffi::build::<RamTier>(json, &HostContext::default())
    }

    #[test]
    fn round_trip_and_accounting() {
        let tier = build("").unwrap();
        assert_eq!(tier.capacity(), u64::MAX);
        tier.put("opt/w/exp_avg", &[1, 2, 3, 4], DType::U8).unwrap();
        tier.put("act/0", &[9; 10], DType::U8).unwrap();
        assert_eq!(tier.used_bytes(), 14);
        assert_eq!(tier.len("opt/w/exp_avg").unwrap(), Some(4));
        assert_eq!(tier.len("missing").unwrap(), None);
        tier.prefetch("act/0").unwrap();

        let mut back = [0u8; 4];
        tier.get("opt/w/exp_avg", &mut back).unwrap();
        assert_eq!(back, [1, 2, 3, 4]);

        // Replacing a record counts only the new size.
        tier.put("opt/w/exp_avg", &[7; 6], DType::U8).unwrap();
        assert_eq!(tier.used_bytes(), 16);
        let mut back = [0u8; 6];
        tier.get("opt/w/exp_avg", &mut back).unwrap();
        assert_eq!(back, [7; 6]);

        tier.evict("act/0").unwrap();
        assert_eq!(tier.used_bytes(), 6);
        assert_eq!(tier.len("act/0").unwrap(), None);
        // Evicting what is not there is fine.
        tier.evict("act/0").unwrap();
        tier.evict("never").unwrap();
        assert_eq!(tier.used_bytes(), 6);
    }

    #[test]
    fn capacity_is_enforced() {
        let tier = build(r#"{"capacity": "1KiB"}"#).unwrap();
        assert_eq!(tier.capacity(), 1024);
        tier.put("a", &[0; 1000], DType::U8).unwrap();
        let err = tier.put("b", &[0; 25], DType::U8).unwrap_err();
        assert_eq!(err.kind, ErrorKind::OutOfMemory);
        assert_eq!(err.message.as_str(), "ram tier: cannot store 25 bytes under key 'b': 1000 of 1024 bytes in use");
        assert_eq!((tier.used_bytes(), tier.len("b").unwrap()), (1000, None));
        // Exactly full is allowed; replacing a record frees its old size first.
        tier.put("b", &[0; 24], DType::U8).unwrap();
        tier.put("a", &[1; 990], DType::U8).unwrap();
        assert_eq!(tier.used_bytes(), 1014);
        let err = tier.put("a", &[2; 1001], DType::U8).unwrap_err();
        assert_eq!(
            err.message.as_str(),
            "ram tier: cannot store 1001 bytes under key 'a': 1014 of 1024 bytes in use (990 of them by the record it would replace)"
        );
        // A refused replacement keeps the old record.
        let mut back = vec![0u8; 990];
        tier.get("a", &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 1));
    }

    #[test]
    fn get_errors_name_the_key() {
        let tier = RamTier::new(None);
        tier.put("k", &[1, 2, 3], DType::U8).unwrap();
        let err = tier.get("k", &mut [0u8; 2]).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidInput);
        assert_eq!(err.message.as_str(), "ram tier: record 'k' has 3 bytes, the buffer to read it into has 2");
        let err = tier.get("nope", &mut [0u8; 3]).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidInput);
        assert_eq!(err.message.as_str(), "ram tier: no record under key 'nope'");
    }

    /// The tier is shared between an I/O thread and compute (`&self` methods).
    #[test]
    fn concurrent_puts_are_all_counted() {
        let tier = RamTier::new(None);
        std::thread::scope(|s| {
            for t in 0..4u8 {
                let tier = &tier;
                s.spawn(move || {
                    for i in 0..50 {
                        tier.put(&format!("{t}/{i}"), &[t; 8], DType::U8).unwrap();
                    }
                });
            }
        });
        assert_eq!(tier.used_bytes(), 4 * 50 * 8);
    }

    #[test]
    fn options_are_checked() {
        let err = build(r#"{"capacity": 0}"#).unwrap_err();
        assert_eq!(
            err.details().collect::<Vec<_>>(),
            ["option 'capacity': 0 bytes holds nothing; leave it unset for no limit"]
        );
        let err = build(r#"{"capacity": "lots"}"#).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidOptions);
        assert_eq!(build(r#"{"capacity": 4096}"#).unwrap().capacity(), 4096);
    }

    #[test]
    fn registered() {
        let b = crate::builtin::all().find(|b| (b.manifest)().name.as_str() == "ram").expect("registered");
        let m = (b.manifest)();
        m.validate().unwrap();
        assert_eq!(m.kind, PluginKind::Offload);
        assert_eq!(m.options[0].default.as_str(), "null");
        assert_eq!((b.create)("", &HostContext::default()).unwrap().kind(), PluginKind::Offload);
    }
}
