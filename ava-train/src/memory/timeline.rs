//! A memory timeline: every allocation and release the counting allocator sees while a
//! timeline is armed, with its time, size, address and owner (the innermost profiler scope
//! open when it happened, e.g. `backward: linear`), for one step at a time
//! (`ava bench train --memory-trace STEP`, `ava train --memory-trace STEP,…`).
//!
//! The allocator must not allocate, so the events go into a buffer allocated when the
//! timeline is [`arm`]ed ([`Event`]s, [`DEFAULT_CAPACITY`] of them unless asked otherwise),
//! each claimed by one atomic increment; events past its end are counted as dropped. The
//! buffer is the system allocator's, outside the counting allocator, so the events take none
//! of the counted memory (the profiler a recorded step runs with keeps a few KiB of spans).
//!
//! The owner is a small number: scope names are interned into a fixed table as scopes open
//! ([`enter`]) on the thread that armed the timeline, the current one kept in one
//! process-wide atomic. The allocations of rayon's workers belong to the scope that thread
//! has open, which is what a reader wants: a product's packing buffers are the product's.
//! Other threads' scopes (the loader's, other ranks' in one process) name no owner.
//!
//! Memory held when the timeline was armed (parameters, gradients, optimizer state, queued
//! batches) is one lump, "held before", which releases of its buffers make smaller. What a
//! plugin library allocates through its own Rust allocator (a `.so` has its own) is not
//! seen: the counting allocator does not see it either.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering::*};
use std::time::Instant;

/// Events a timeline keeps unless [`arm`] is told otherwise: 32 bytes each, 8 MiB in all.
pub const DEFAULT_CAPACITY: usize = 1 << 18;

/// Owner names kept at most; scopes past them are owned by [`UNTAGGED`].
const OWNERS: usize = 255;

/// Counter samples a trace gets at most per timeline.
pub const COUNTER_ROWS: usize = 4000;

/// The largest allocations a trace marks with an instant event.
pub const INSTANTS: usize = 50;

/// What a peak at the moment of arming (nothing rose above it) is said to be made by.
pub const ARMING: &str = "(held when recording started)";

/// The owner of an allocation made outside every profiler scope.
pub const UNTAGGED: &str = "(outside the profiled scopes)";

/// One allocation (`bytes` > 0) or release (`bytes` < 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    /// Nanoseconds since the timeline was armed.
    pub t_ns: u64,
    /// The block's address.
    pub addr: usize,
    /// Bytes allocated (positive) or released (negative).
    pub bytes: i64,
    /// Index into the timeline's owner names (0: [`UNTAGGED`]).
    pub owner: u32,
}

static ARMED: AtomicBool = AtomicBool::new(false);
/// Recorders between their check of `ARMED` and the end of their write.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
static BUF: AtomicPtr<Event> = AtomicPtr::new(std::ptr::null_mut());
static CAP: AtomicUsize = AtomicUsize::new(0);
static NEXT: AtomicUsize = AtomicUsize::new(0);
static OWNER: AtomicU32 = AtomicU32::new(0);
/// The [`thread_id`] of the thread that armed the timeline: only its scopes name owners.
static ARMER: AtomicU64 = AtomicU64::new(0);
/// The origin in nanoseconds of a process-wide clock the allocator can read lock-free.
static ORIGIN_NS: AtomicUsize = AtomicUsize::new(0);
/// The armed timeline: its buffer's address and capacity, the bytes held when it was armed,
/// and when.
static STATE: Mutex<Option<(usize, usize, u64, Instant)>> = Mutex::new(None);
/// The owner names, numbered from 1 in the order first seen.
static NAMES: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
/// The names as (pointer, length), readable without the lock.
static NAME_PTRS: [AtomicPtr<u8>; OWNERS] = [const { AtomicPtr::new(std::ptr::null_mut()) }; OWNERS];
static NAME_LENS: [AtomicUsize; OWNERS] = [const { AtomicUsize::new(0) }; OWNERS];
static NAMED: AtomicUsize = AtomicUsize::new(0);

/// Nanoseconds on a monotonic clock shared by the process (from its first use).
fn clock_ns() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Whether a timeline is armed (one relaxed load: the allocator's only cost when it is not).
#[inline]
pub fn is_armed() -> bool {
    ARMED.load(Relaxed)
}

/// Starts recording into a fresh buffer of `capacity` events. The buffer comes from the
/// system allocator directly, so no counter sees it. If it cannot be had, every event is
/// counted as dropped. A timeline already armed is dropped first. The calling thread's
/// profiler scopes name the owners ([`enter`]); other threads' scopes are not followed.
pub fn arm(capacity: usize) {
    // One lock over the whole change: a recorder never sees one timeline's buffer with
    // another's capacity.
    let mut state = STATE.lock().expect("timeline lock");
    drop(stop(&mut state));
    let (ptr, capacity) = match Layout::array::<Event>(capacity) {
        // SAFETY: the layout has a non-zero size (capacity > 0 and Event is not zero-sized).
        Ok(layout) if capacity > 0 => (unsafe { System.alloc(layout) }.cast::<Event>(), capacity),
        _ => (std::ptr::null_mut(), 0),
    };
    let capacity = if ptr.is_null() { 0 } else { capacity };
    BUF.store(ptr, SeqCst);
    CAP.store(capacity, SeqCst);
    NEXT.store(0, SeqCst);
    OWNER.store(0, SeqCst);
    ARMER.store(thread_id(), SeqCst);
    ORIGIN_NS.store(clock_ns() as usize, SeqCst);
    *state = Some((ptr as usize, capacity, crate::memory::current(), Instant::now()));
    ARMED.store(true, SeqCst);
}

/// A number for the calling thread, unique in the process (from 1).
fn thread_id() -> u64 {
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static ID: u64 = NEXT_ID.fetch_add(1, Relaxed);
    }
    ID.with(|id| *id)
}

/// Records one event if a timeline is armed. Called by the counting allocator; allocates
/// nothing.
#[inline]
pub(crate) fn record(addr: usize, bytes: i64) {
    if !ARMED.load(Relaxed) {
        return;
    }
    IN_FLIGHT.fetch_add(1, SeqCst);
    if ARMED.load(SeqCst) {
        let i = NEXT.fetch_add(1, SeqCst);
        if i < CAP.load(SeqCst) {
            let t_ns = clock_ns().saturating_sub(ORIGIN_NS.load(Relaxed) as u64);
            let owner = OWNER.load(Relaxed);
            // SAFETY: the buffer holds CAP events and lives until `disarm`, which waits for
            // every recorder in flight; slot i was claimed by this call alone.
            unsafe { BUF.load(SeqCst).add(i).write(Event { t_ns, addr, bytes, owner }) };
        }
    }
    IN_FLIGHT.fetch_sub(1, SeqCst);
}

/// The owner number of scope `name`, interned on first sight (0 once the table is full).
fn owner_of(name: &'static str) -> u32 {
    let named = NAMED.load(Acquire);
    for i in 0..named {
        let (p, len) = (NAME_PTRS[i].load(Relaxed), NAME_LENS[i].load(Relaxed));
        // SAFETY: slot i holds a `&'static str`'s pointer and length (stored before NAMED
        // counted it, published by its release store).
        if len == name.len() && unsafe { std::slice::from_raw_parts(p, len) } == name.as_bytes() {
            return i as u32 + 1;
        }
    }
    let mut names = NAMES.lock().expect("timeline lock");
    if let Some(i) = names.iter().position(|n| *n == name) {
        return i as u32 + 1;
    }
    if names.len() >= OWNERS {
        return 0;
    }
    let i = names.len();
    names.push(name);
    NAME_PTRS[i].store(name.as_ptr().cast_mut(), Relaxed);
    NAME_LENS[i].store(name.len(), Relaxed);
    NAMED.store(i + 1, Release);
    i as u32 + 1
}

/// Makes `name` the owner of what is allocated until the returned guard drops (which puts
/// back the owner before it). Called by the profiler as a scope opens; nothing while no
/// timeline is armed, or on a thread other than the one that armed it.
pub fn enter(name: &'static str) -> Option<OwnerGuard> {
    if !is_armed() || ARMER.load(Relaxed) != thread_id() {
        return None;
    }
    let id = owner_of(name);
    Some(OwnerGuard { previous: OWNER.swap(id, SeqCst) })
}

/// Puts back the owner that was current before [`enter`].
#[derive(Debug)]
pub struct OwnerGuard {
    previous: u32,
}

impl Drop for OwnerGuard {
    fn drop(&mut self) {
        OWNER.store(self.previous, SeqCst);
    }
}

/// A recorded timeline.
#[derive(Debug, Clone)]
pub struct Timeline {
    /// The events, in the order they claimed their slots.
    pub events: Vec<Event>,
    /// Owner names by number (0: [`UNTAGGED`]).
    pub owners: Vec<&'static str>,
    /// Bytes the counting allocator held when the timeline was armed.
    pub held_before: u64,
    /// Events past the buffer's capacity, not kept.
    pub dropped: u64,
    /// Events the buffer could hold (0: it could not be allocated).
    pub capacity: usize,
    /// When it was armed.
    pub armed_at: Instant,
}

/// Stops recording and returns what was recorded (None if no timeline was armed).
pub fn disarm() -> Option<Timeline> {
    stop(&mut STATE.lock().expect("timeline lock"))
}

/// [`disarm`] with the state's lock held.
fn stop(state: &mut Option<(usize, usize, u64, Instant)>) -> Option<Timeline> {
    ARMED.store(false, SeqCst);
    let mut spins = 0u32;
    while IN_FLIGHT.load(SeqCst) != 0 {
        // A recorder preempted between its claim and its write holds this up for a time
        // slice: yield rather than spin through it.
        spins += 1;
        if spins > 64 { std::thread::yield_now() } else { std::hint::spin_loop() }
    }
    let (addr, capacity, held_before, armed_at) = state.take()?;
    let ptr = addr as *mut Event;
    let claimed = NEXT.load(SeqCst);
    let kept = claimed.min(capacity);
    BUF.store(std::ptr::null_mut(), SeqCst);
    CAP.store(0, SeqCst);
    let events = if ptr.is_null() {
        Vec::new()
    } else {
        // SAFETY: slots 0..kept were each written whole by one recorder, all of which
        // finished (IN_FLIGHT is 0, and none writes once ARMED is false); the buffer came
        // from `System` with this layout in `arm`.
        unsafe {
            let events = std::slice::from_raw_parts(ptr, kept).to_vec();
            System.dealloc(ptr.cast(), Layout::array::<Event>(capacity).expect("the layout arm made"));
            events
        }
    };
    let mut owners = vec![UNTAGGED];
    owners.extend(NAMES.lock().expect("timeline lock").iter().copied());
    Some(Timeline { events, owners, held_before, dropped: (claimed - kept) as u64, capacity, armed_at })
}

/// One allocation live at the peak.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Live {
    /// Its owner's name.
    pub owner: &'static str,
    /// Its size in bytes.
    pub bytes: u64,
    /// When it was made, nanoseconds after arming.
    pub t_ns: u64,
}

/// The highest point of a timeline and what held it.
#[derive(Debug, Clone, PartialEq)]
pub struct Peak {
    /// Bytes held at the peak (the "held before" lump included).
    pub bytes: u64,
    /// When, nanoseconds after arming.
    pub t_ns: u64,
    /// The owner of the allocation that made the peak.
    pub owner: &'static str,
    /// What was left of the "held before" lump then.
    pub held_before: u64,
    /// The allocations made since arming and live at the peak, largest first.
    pub live: Vec<Live>,
}

/// A timeline's events applied in order: the blocks allocated since arming and still live,
/// and the bytes held by column (0: the "held before" lump, owner + 1 else). A release of a
/// block from before arming shrinks the lump; an allocation at an address still live (its
/// release not seen) replaces that block.
struct Replay {
    /// address → (bytes, owner, time allocated).
    live: HashMap<usize, (u64, u32, u64)>,
    held: Vec<i128>,
    /// The sum of `held`.
    total: i128,
}

impl Replay {
    fn new(t: &Timeline) -> Replay {
        let mut held = vec![0i128; t.owners.len() + 1];
        held[0] = i128::from(t.held_before);
        Replay { live: HashMap::new(), held, total: i128::from(t.held_before) }
    }

    fn apply(&mut self, e: &Event) {
        let mut change = |column: usize, delta: i128| {
            self.held[column] += delta;
            self.total += delta;
        };
        if e.bytes >= 0 {
            if let Some((b, o, _)) = self.live.insert(e.addr, (e.bytes as u64, e.owner, e.t_ns)) {
                change(o as usize + 1, -i128::from(b));
            }
            change(e.owner as usize + 1, i128::from(e.bytes));
        } else {
            match self.live.remove(&e.addr) {
                Some((b, o, _)) => change(o as usize + 1, -i128::from(b)),
                None => change(0, i128::from(e.bytes)),
            }
        }
    }
}

impl Peak {
    /// The live allocations grouped by owner: (owner, how many, bytes), most bytes first.
    pub fn by_owner(&self) -> Vec<(&'static str, usize, u64)> {
        let mut groups: HashMap<&'static str, (usize, u64)> = HashMap::new();
        for l in &self.live {
            let g = groups.entry(l.owner).or_default();
            g.0 += 1;
            g.1 += l.bytes;
        }
        let mut v: Vec<_> = groups.into_iter().map(|(o, (n, b))| (o, n, b)).collect();
        v.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(b.0)));
        v
    }
}

impl Timeline {
    /// Bytes the buffer took while recording (from the system allocator, outside every count).
    pub fn buffer_bytes(&self) -> u64 {
        (self.capacity * std::mem::size_of::<Event>()) as u64
    }

    /// The peak: the first point where the most bytes were held (arming itself, when nothing
    /// rose above what was held then), and the blocks allocated since arming still live then.
    /// None without events.
    pub fn peak(&self) -> Option<Peak> {
        if self.events.is_empty() {
            return None;
        }
        let (at, bytes) = self.peak_index();
        let mut replay = Replay::new(self);
        let upto = at.map_or(&[][..], |at| &self.events[..=at]);
        upto.iter().for_each(|e| replay.apply(e));
        let mut live: Vec<Live> = replay
            .live
            .into_values()
            .map(|(bytes, owner, t_ns)| Live { owner: self.owner_name(owner), bytes, t_ns })
            .collect();
        live.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.t_ns.cmp(&b.t_ns)));
        // The time made non-decreasing, as in `times`.
        let t_ns = upto.iter().map(|e| e.t_ns).max().unwrap_or(0);
        let owner = at.map_or(ARMING, |at| self.owner_name(self.events[at].owner));
        Some(Peak { bytes: bytes.max(0) as u64, t_ns, owner, held_before: replay.held[0].max(0) as u64, live })
    }

    /// The event after which the most bytes were held (the first such; None: at arming,
    /// nothing rose above it), and those bytes.
    fn peak_index(&self) -> (Option<usize>, i128) {
        let mut replay = Replay::new(self);
        let mut best = (None, replay.total);
        for (i, e) in self.events.iter().enumerate() {
            replay.apply(e);
            if replay.total > best.1 {
                best = (Some(i), replay.total);
            }
        }
        best
    }

    /// The events' times made non-decreasing: a slot is claimed before its time is read, so
    /// with several threads allocating a later slot can carry an earlier time.
    fn times(&self) -> Vec<u64> {
        self.events
            .iter()
            .scan(0u64, |latest, e| {
                *latest = (*latest).max(e.t_ns);
                Some(*latest)
            })
            .collect()
    }

    /// Bytes held by column after each event: the "held before" lump first, then each
    /// owner's blocks allocated since arming and still live. Rows are sampled to about
    /// `max_rows` (the peak's row and the last are always kept, so up to two more), each
    /// (nanoseconds after arming, non-decreasing; bytes by column).
    pub fn by_owner(&self, max_rows: usize) -> Vec<(u64, Vec<u64>)> {
        let peak_at = self.peak_index().0;
        let times = self.times();
        let step = self.events.len().div_ceil(max_rows.max(1)).max(1);
        let mut replay = Replay::new(self);
        let mut rows = Vec::new();
        for (i, e) in self.events.iter().enumerate() {
            replay.apply(e);
            if i % step == step - 1 || i + 1 == self.events.len() || Some(i) == peak_at {
                rows.push((times[i], replay.held.iter().map(|&b| b.max(0) as u64).collect()));
            }
        }
        rows
    }

    /// Chrome trace events for this timeline, `offset_us` after the trace's origin: a counter
    /// track of the bytes held by owner in MiB (stacked in chrome://tracing, one track per
    /// owner in Perfetto; [`COUNTER_ROWS`] samples at most), an instant event at the peak,
    /// and one for each of the [`INSTANTS`] largest allocations.
    pub fn to_chrome_events(&self, offset_us: f64, step: &str) -> Vec<serde_json::Value> {
        use serde_json::json;
        let us = |t_ns: u64| offset_us + t_ns as f64 / 1e3;
        let mut names = vec!["held before the step"];
        names.extend(&self.owners);
        let mut events = Vec::new();
        for (t_ns, held) in self.by_owner(COUNTER_ROWS) {
            let args: serde_json::Map<String, serde_json::Value> = names
                .iter()
                .zip(&held)
                .filter(|(_, b)| **b > 0)
                .map(|(n, b)| (n.to_string(), json!(crate::memory::mib(*b))))
                .collect();
            events.push(json!({"name": format!("memory by owner, {step} (MiB)"), "ph": "C", "pid": 1, "ts": us(t_ns), "args": args}));
        }
        if let Some(p) = self.peak() {
            let mut owners = serde_json::Map::new();
            for (owner, count, bytes) in p.by_owner() {
                owners.insert(owner.to_string(), json!(format!("{} in {count}", crate::memory::size(bytes))));
            }
            events.push(json!({
                "name": format!("memory peak of {step}: {}", crate::memory::size(p.bytes)), "ph": "i", "s": "g",
                "pid": 1, "ts": us(p.t_ns),
                "args": {"peak (bytes)": p.bytes, "made by": p.owner, "held before the step (bytes)": p.held_before,
                         "live at the peak, by owner": owners},
            }));
        }
        let mut largest: Vec<&Event> = self.events.iter().filter(|e| e.bytes > 0).collect();
        largest.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.t_ns.cmp(&b.t_ns)));
        for e in largest.into_iter().take(INSTANTS) {
            events.push(json!({
                "name": format!("allocation of {}", crate::memory::size(e.bytes as u64)), "ph": "i", "s": "p",
                "pid": 1, "ts": us(e.t_ns),
                "args": {"bytes": e.bytes, "owner": self.owner_name(e.owner)},
            }));
        }
        events
    }

    /// The whole Chrome trace of a step recorded with this timeline: `spans` (the profiled
    /// scopes, if a span trace ran beside it, see `crate::profile::trace`) and this
    /// timeline's events on the spans' clock, with the counts of both in `otherData`.
    /// `process` names the process in the viewer, `step` the step (`step 3`).
    pub fn chrome_trace(
        &self,
        spans: Option<&crate::profile::trace::Trace>,
        process: &str,
        step: &str,
    ) -> serde_json::Value {
        let (mut chrome, offset_us) = match spans {
            Some(t) => {
                (t.to_chrome_json(process), self.armed_at.saturating_duration_since(t.origin()).as_secs_f64() * 1e6)
            }
            None => (crate::profile::trace::Trace::empty().to_chrome_json(process), 0.0),
        };
        let events = chrome["traceEvents"].as_array_mut().expect("the trace's events are a list");
        events.extend(self.to_chrome_events(offset_us, step));
        chrome["otherData"]["memory events"] = self.events.len().into();
        chrome["otherData"]["memory events dropped (past the timeline's capacity)"] = self.dropped.into();
        chrome
    }

    /// The peak and what was live then, by owner, as JSON (`ava report` reads it back):
    /// `{step, peak_bytes, peak_ms, made_in, held_before_bytes, events, dropped, live_by_owner:
    /// [{owner, buffers, bytes}]}`, or None without events.
    pub fn summary_json(&self, step: u64) -> Option<serde_json::Value> {
        let p = self.peak()?;
        let owners: Vec<serde_json::Value> = p
            .by_owner()
            .into_iter()
            .map(|(owner, buffers, bytes)| serde_json::json!({"owner": owner, "buffers": buffers, "bytes": bytes}))
            .collect();
        Some(serde_json::json!({
            "step": step, "peak_bytes": p.bytes, "peak_ms": p.t_ns as f64 / 1e6, "made_in": p.owner,
            "held_before_bytes": p.held_before, "events": self.events.len(), "dropped": self.dropped,
            "live_by_owner": owners,
        }))
    }

    fn owner_name(&self, owner: u32) -> &'static str {
        self.owners.get(owner as usize).copied().unwrap_or(UNTAGGED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(t_ns: u64, addr: usize, bytes: i64, owner: u32) -> Event {
        Event { t_ns, addr, bytes, owner }
    }

    fn timeline(events: Vec<Event>) -> Timeline {
        Timeline {
            events,
            owners: vec![UNTAGGED, "forward", "backward"],
            held_before: 1000,
            dropped: 0,
            capacity: 0,
            armed_at: Instant::now(),
        }
    }

    #[test]
    fn the_peak_lists_what_was_live_then_largest_first() {
        let t = timeline(vec![
            ev(1, 0xa, 100, 1),
            ev(2, 0xb, 300, 1),
            ev(3, 0xc, 50, 2),
            ev(4, 0xb, -300, 2), // released: not live at a later peak
            ev(5, 0xd, 400, 2),  // peak: 1000 + 100 + 50 + 400 = 1550
            ev(6, 0xa, -100, 2),
            ev(7, 0x1, -200, 2), // a block from before arming: the lump shrinks
        ]);
        let p = t.peak().unwrap();
        assert_eq!((p.bytes, p.t_ns, p.owner, p.held_before), (1550, 5, "backward", 1000));
        let live: Vec<(&str, u64)> = p.live.iter().map(|l| (l.owner, l.bytes)).collect();
        assert_eq!(live, [("backward", 400), ("forward", 100), ("backward", 50)]);
    }

    #[test]
    fn the_live_buffers_group_by_owner_and_the_trace_marks_the_peak_and_the_largest() {
        let t = timeline(vec![ev(1, 0xa, 100, 1), ev(2, 0xb, 300, 2), ev(3, 0xc, 200, 1), ev(4, 0xb, -300, 2)]);
        let p = t.peak().unwrap();
        assert_eq!(p.by_owner(), [("backward", 1, 300), ("forward", 2, 300)]); // ties by name
        let events = t.to_chrome_events(1000.0, "step 3");
        let counters: Vec<_> = events.iter().filter(|e| e["ph"] == "C").collect();
        assert_eq!(counters.len(), 4);
        // At t 2 ns: 1000 before, 100 forward, 300 backward (owners with nothing are left out).
        let row = &counters[1]["args"];
        assert_eq!(row.as_object().unwrap().len(), 3);
        assert_eq!(row["backward"].as_f64().unwrap() * 1048576.0, 300.0);
        assert_eq!(counters[1]["ts"].as_f64(), Some(1000.002));
        let peak = events.iter().find(|e| e["ph"] == "i" && e["s"] == "g").unwrap();
        assert_eq!(peak["args"]["peak (bytes)"], 1600);
        assert_eq!(peak["ts"].as_f64(), Some(1000.003));
        let largest: Vec<i64> =
            events.iter().filter(|e| e["s"] == "p").map(|e| e["args"]["bytes"].as_i64().unwrap()).collect();
        assert_eq!(largest, [300, 200, 100]);
    }

    #[test]
    fn an_address_allocated_again_before_its_release_replaces_the_block() {
        // 0xa's release was not seen (e.g. lost past the capacity): the second allocation
        // there replaces the first instead of counting both.
        let t = timeline(vec![ev(1, 0xa, 100, 1), ev(2, 0xa, 300, 2), ev(3, 0xb, 10, 1)]);
        let p = t.peak().unwrap();
        assert_eq!((p.bytes, p.live.len()), (1310, 2));
        assert_eq!(t.by_owner(10).last().unwrap().1, vec![1000, 0, 10, 300]);
    }

    #[test]
    fn a_step_that_only_releases_peaks_when_recording_started() {
        let t = timeline(vec![ev(5, 0x1, -200, 1), ev(6, 0x2, -100, 2)]);
        let p = t.peak().unwrap();
        assert_eq!((p.bytes, p.t_ns, p.owner, p.held_before, p.live.len()), (1000, 0, ARMING, 1000, 0));
    }

    #[test]
    fn times_that_go_back_across_threads_are_drawn_in_order() {
        let t = timeline(vec![ev(5, 0xa, 100, 1), ev(3, 0xb, 100, 1), ev(7, 0xb, -100, 1)]);
        let times: Vec<u64> = t.by_owner(10).iter().map(|r| r.0).collect();
        assert_eq!(times, [5, 5, 7]);
        assert_eq!(t.peak().unwrap().t_ns, 5);
    }

    #[test]
    fn a_release_of_an_older_block_shrinks_the_lump_before_the_peak() {
        let t = timeline(vec![ev(1, 0x1, -600, 1), ev(2, 0xa, 700, 1)]);
        let p = t.peak().unwrap();
        // 1000 - 600 + 700 = 1100 at t 2, of which 400 is what is left of the lump.
        assert_eq!((p.bytes, p.held_before, p.live.len()), (1100, 400, 1));
    }

    #[test]
    fn by_owner_keeps_each_owners_live_bytes_and_the_peak_row() {
        let t = timeline(vec![ev(1, 0xa, 100, 1), ev(2, 0xb, 300, 2), ev(3, 0xa, -100, 2), ev(4, 0x1, -50, 0)]);
        let rows = t.by_owner(100);
        assert_eq!(rows.len(), 4);
        // Columns: the lump, then owners 0 (untagged), 1 (forward), 2 (backward).
        assert_eq!(rows[1], (2, vec![1000, 0, 100, 300]));
        assert_eq!(rows[2], (3, vec![1000, 0, 0, 300]));
        assert_eq!(rows[3], (4, vec![950, 0, 0, 300]));
        // Sampled down to every other row (rows 1 and 3 of 0..4), the peak (row 0, t 1) is kept.
        let t = timeline(vec![ev(1, 0xa, 500, 1), ev(2, 0xa, -500, 2), ev(3, 0xb, 10, 1), ev(4, 0xb, -10, 1)]);
        let rows = t.by_owner(2);
        assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), [1, 2, 4], "{rows:?}");
        assert_eq!(rows[0].1, vec![1000, 0, 500, 0]);
    }

    #[test]
    fn an_armed_timeline_records_allocations_under_the_open_scope() {
        // Recorded directly (the test binary has no counting allocator installed).
        arm(16);
        let guard = enter("timeline test: scope");
        record(0x10, 64);
        drop(guard);
        record(0x10, -64);
        for i in 0..20 {
            record(0x20 + i, 8); // past the capacity: dropped
        }
        let t = disarm().expect("armed");
        assert!(!is_armed());
        assert_eq!(t.events.len(), 16);
        assert_eq!(t.dropped, 6);
        let owner = t.owners[t.events[0].owner as usize];
        assert_eq!((owner, t.events[0].bytes), ("timeline test: scope", 64));
        assert_eq!(t.owners[t.events[1].owner as usize], UNTAGGED);
        assert!(t.events.windows(2).all(|w| w[0].t_ns <= w[1].t_ns));
        record(0x30, 8); // disarmed: nothing
        assert!(disarm().is_none());
        // Only the arming thread's scopes name owners.
        arm(4);
        let other = std::thread::spawn(|| enter("timeline test: another thread").is_some()).join().unwrap();
        assert!(!other, "a scope on another thread names no owner");
        assert!(enter("timeline test: this thread").is_some());
        drop(disarm());
    }
}
