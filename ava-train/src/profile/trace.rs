//! The profiler's scopes as a timeline (`ava bench train --trace FILE`): each timed scope a
//! span with its thread, start and duration, beside the host memory the counting allocator
//! held at its start and end, written as Chrome's trace-event JSON (complete events `X`
//! for the spans, a counter track `C` for the memory) that Perfetto (ui.perfetto.dev) and
//! `chrome://tracing` open.
//!
//! While a trace is on, every scope the profiler times (see the parent module: a scope
//! nested in one of the same name is not timed again) is also kept here, up to [`CAPACITY`]
//! spans; later ones are counted as dropped, and the file says how many. The spans are kept
//! in memory that the counting allocator counts, so a traced step's memory figures include
//! them: [`Trace::bytes`] says how much.

use std::borrow::Cow;
use std::cell::Cell;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use serde_json::{Value, json};

/// Spans kept at most (about 64 bytes each).
pub const CAPACITY: usize = 1 << 18;

/// One timed scope.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// The scope's name (or a step's, `step 12`).
    pub name: Cow<'static, str>,
    /// The thread it ran on: 1 for the first thread seen, and so on.
    pub thread: u64,
    /// Microseconds from the trace's start.
    pub start_us: f64,
    /// Its length in microseconds.
    pub dur_us: f64,
    /// Bytes the counting allocator held when it started and when it ended.
    pub held: (u64, u64),
}

/// The spans of a trace, in the order they ended.
#[derive(Debug)]
pub struct Trace {
    origin: Instant,
    /// The spans kept.
    pub spans: Vec<Span>,
    /// Spans past [`CAPACITY`], not kept.
    pub dropped: u64,
}

static TRACE: Mutex<Option<Trace>> = Mutex::new(None);
/// Whether [`TRACE`] is on, read without its lock.
static ON: AtomicBool = AtomicBool::new(false);
static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's number in traces (0: none yet).
    static THREAD: Cell<u64> = const { Cell::new(0) };
}

fn thread_number() -> u64 {
    THREAD.with(|t| {
        if t.get() == 0 {
            t.set(NEXT_THREAD.fetch_add(1, Ordering::Relaxed));
        }
        t.get()
    })
}

/// Starts keeping spans (a trace already on starts again, empty).
pub fn start() {
    *TRACE.lock().expect("trace lock") = Some(Trace { origin: Instant::now(), spans: Vec::new(), dropped: 0 });
    ON.store(true, Ordering::Relaxed);
}

/// Stops keeping spans and returns them (None if no trace was on).
pub fn take() -> Option<Trace> {
    ON.store(false, Ordering::Relaxed);
    TRACE.lock().expect("trace lock").take()
}

/// Whether a trace is on.
pub fn is_on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Keeps the span `name` from `start` to now, with the bytes held then and now, if a trace
/// is on.
pub fn record(name: Cow<'static, str>, start: Instant, held_at_start: u64) {
    let end = Instant::now();
    let held_at_end = crate::memory::current();
    let thread = thread_number();
    let mut guard = TRACE.lock().expect("trace lock");
    let Some(trace) = guard.as_mut() else { return };
    if trace.spans.len() >= CAPACITY {
        trace.dropped += 1;
        return;
    }
    let at = |t: Instant| t.saturating_duration_since(trace.origin).as_secs_f64() * 1e6;
    let (start_us, end_us) = (at(start), at(end));
    trace.spans.push(Span { name, thread, start_us, dur_us: end_us - start_us, held: (held_at_start, held_at_end) });
}

impl Trace {
    /// A trace with no spans, starting now.
    pub fn empty() -> Trace {
        Trace { origin: Instant::now(), spans: Vec::new(), dropped: 0 }
    }

    /// When the trace started: the spans' times are microseconds after it.
    pub fn origin(&self) -> Instant {
        self.origin
    }

    /// Bytes the kept spans take (counted in the memory figures of the traced steps).
    pub fn bytes(&self) -> u64 {
        (self.spans.capacity() * std::mem::size_of::<Span>()) as u64
    }

    /// Chrome's trace-event JSON (the object form): the process and thread names, each span
    /// as a complete event (`ph: X`, microseconds), and the host memory held as a counter
    /// track in MiB, sampled at every span's start and end, in time order. `process` names
    /// the process (e.g. `ava bench train configs/small.yaml`).
    pub fn to_chrome_json(&self, process: &str) -> Value {
        let mut events = vec![json!({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": process}})];
        let mut threads: Vec<u64> = self.spans.iter().map(|s| s.thread).collect();
        threads.sort_unstable();
        threads.dedup();
        for t in threads {
            events.push(
                json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": t, "args": {"name": format!("thread {t}")}}),
            );
        }
        for s in &self.spans {
            events.push(json!({
                "name": s.name, "cat": "scope", "ph": "X", "pid": 1, "tid": s.thread,
                "ts": s.start_us, "dur": s.dur_us,
                "args": {"held at start (bytes)": s.held.0, "held at end (bytes)": s.held.1},
            }));
        }
        let mut samples: Vec<(f64, u64)> =
            self.spans.iter().flat_map(|s| [(s.start_us, s.held.0), (s.start_us + s.dur_us, s.held.1)]).collect();
        samples.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (ts, held) in samples {
            let mib = crate::memory::mib(held);
            events.push(json!({"name": "host memory held (MiB)", "ph": "C", "pid": 1, "ts": ts, "args": {"MiB": mib}}));
        }
        json!({
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"spans": self.spans.len(), "spans dropped (past the trace's capacity)": self.dropped},
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_become_complete_events_and_memory_a_counter_in_time_order() {
        let origin = Instant::now();
        let span = |name: &'static str, thread, start_us, dur_us, held| Span {
            name: Cow::Borrowed(name),
            thread,
            start_us,
            dur_us,
            held,
        };
        let trace = Trace {
            origin,
            // The inner span ends first, as a nested scope does.
            spans: vec![
                span("forward: attention kernel", 1, 10.0, 5.0, (100, 300)),
                span("step 3", 1, 0.0, 40.0, (0, 50)),
            ],
            dropped: 2,
        };
        let json = trace.to_chrome_json("ava bench train");
        let events = json["traceEvents"].as_array().unwrap();
        assert_eq!(events[0]["args"]["name"], "ava bench train");
        assert_eq!(events[1]["ph"], "M");
        assert_eq!(events[1]["tid"], 1);
        let spans: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(spans.len(), 2);
        assert_eq!(spans[0]["name"], "forward: attention kernel");
        assert_eq!((spans[0]["ts"].as_f64(), spans[0]["dur"].as_f64()), (Some(10.0), Some(5.0)));
        assert_eq!(spans[0]["args"]["held at end (bytes)"], 300);
        let counter: Vec<(f64, f64)> = events
            .iter()
            .filter(|e| e["ph"] == "C")
            .map(|e| (e["ts"].as_f64().unwrap(), e["args"]["MiB"].as_f64().unwrap() * 1048576.0))
            .collect();
        assert_eq!(counter, [(0.0, 0.0), (10.0, 100.0), (15.0, 300.0), (40.0, 50.0)]);
        assert_eq!(json["otherData"]["spans dropped (past the trace's capacity)"], 2);
    }

    #[test]
    fn a_trace_keeps_what_is_recorded_while_it_is_on() {
        // Its own span names: the trace is process-wide, and other tests may record too.
        record(Cow::Borrowed("trace test: before"), Instant::now(), 0);
        start();
        assert!(is_on());
        let t0 = Instant::now();
        record(Cow::Owned("trace test: on".into()), t0, 7);
        let trace = take().expect("the trace was on");
        assert!(!is_on());
        record(Cow::Borrowed("trace test: after"), Instant::now(), 0);
        let names: Vec<&str> =
            trace.spans.iter().map(|s| s.name.as_ref()).filter(|n| n.starts_with("trace test")).collect();
        assert_eq!(names, ["trace test: on"]);
        let s = trace.spans.iter().find(|s| s.name == "trace test: on").unwrap();
        assert_eq!(s.held.0, 7);
        assert!(s.start_us >= 0.0 && s.dur_us >= 0.0);
    }
}
