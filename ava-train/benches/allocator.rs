//! What the counting allocator costs per allocation, and what a memory timeline adds while
//! it records (`ava train --memory-trace`) and while it does not (every other step): one
//! 4 KiB allocation and its release through the system allocator directly, through the
//! counting allocator with no timeline armed, and with one armed.
//!
//! `cargo bench -p ava-train --bench allocator`

use std::alloc::{GlobalAlloc, Layout, System};

use ava_train::memory::{CountingAlloc, timeline};

#[global_allocator]
static A: CountingAlloc = CountingAlloc;

fn main() {
    divan::main();
}

const LAYOUT: Layout = match Layout::from_size_align(4096, 8) {
    Ok(l) => l,
    Err(_) => panic!("a valid layout"),
};

/// One allocation and its release through `alloc`.
fn pair(alloc: &dyn GlobalAlloc) {
    // SAFETY: the layout is valid and non-zero; the block is released with it.
    unsafe {
        let p = alloc.alloc(LAYOUT);
        assert!(!p.is_null());
        alloc.dealloc(divan::black_box(p), LAYOUT);
    }
}

#[divan::bench(sample_count = 200, sample_size = 1000)]
fn system_allocator() {
    pair(&System);
}

#[divan::bench(sample_count = 200, sample_size = 1000)]
fn counting_no_timeline() {
    pair(&A);
}

#[divan::bench(sample_count = 200, sample_size = 1000)]
fn counting_timeline_recording(bencher: divan::Bencher) {
    // Room for every event of the samples: none is dropped (which would be cheaper).
    timeline::arm(2 * 200 * 1000 + 16);
    bencher.bench_local(|| pair(&A));
    drop(timeline::disarm());
}
