//! Spreading a kernel's tasks over the threads the host grants.
//!
//! Every task owns the slices it writes, so results never depend on which thread ran a
//! task or in what order; only the task list (fixed by the shape) decides the arithmetic.
//! The threads are scoped and live for one call: plugins do not keep pools of their own.

use std::sync::Mutex;

/// Threads [`run`] and [`run_in`] use for `tasks` tasks: at most `threads` (at least 1),
/// at most one per task. A kernel declares its workspace per thread with it.
pub fn workers(threads: u32, tasks: usize) -> usize {
    (threads.max(1) as usize).min(tasks)
}

/// Elements below which an elementwise pass stays on one thread. Starting a scoped thread
/// costs tens of microseconds; one core takes about 0.1 ms for this many elements of an
/// AdamW step, so a smaller split would save little more than it costs.
pub const MIN_ELEMENTS_PER_THREAD: usize = 1 << 16;

/// Elements per task for an elementwise pass over `n` elements with at most `threads`
/// threads: `n` itself (one task) below two [`MIN_ELEMENTS_PER_THREAD`] runs, else an equal
/// share per thread, never under that minimum (at least 1, so `chunks` accepts it). Which
/// thread computes an element changes nothing in its arithmetic, so such a pass gives the
/// same bits for every thread count.
pub fn elementwise_chunk(n: usize, threads: u32) -> usize {
    let parts = (n / MIN_ELEMENTS_PER_THREAD).clamp(1, threads.max(1) as usize);
    n.div_ceil(parts).max(1)
}

/// Runs `work(&mut scratch, task)` on every task with at most `threads` threads, each
/// taking the next task from a shared queue (tasks of unequal cost balance themselves; put
/// the expensive ones first). `scratch` is made once per thread by `init`.
pub fn run<T: Send, S>(tasks: Vec<T>, threads: u32, init: impl Fn() -> S + Sync, work: impl Fn(&mut S, T) + Sync) {
    run_in(tasks, threads, &mut [], 0, |_| init(), work);
}

/// [`run`] with each thread's scratch carved from `workspace` (the host's buffer, which the
/// kernel declared as [`workers`]`(threads, tasks) · per_thread` f32s): thread `i` gets the
/// `i`-th run of `per_thread` elements and makes its scratch from it with `make`.
///
/// # Panics
/// If `workspace` is shorter than that (kernels check its length before calling).
pub fn run_in<'w, T: Send, S>(
    tasks: Vec<T>,
    threads: u32,
    workspace: &'w mut [f32],
    per_thread: usize,
    make: impl Fn(&'w mut [f32]) -> S + Sync,
    work: impl Fn(&mut S, T) + Sync,
) {
    let threads = workers(threads, tasks.len());
    if threads == 0 {
        return;
    }
    assert!(
        workspace.len() >= threads * per_thread,
        "workspace of {} f32s for {threads} threads of {per_thread}",
        workspace.len()
    );
    let mut parts = Vec::with_capacity(threads);
    let mut rest = workspace;
    for _ in 0..threads {
        let (part, tail) = std::mem::take(&mut rest).split_at_mut(per_thread);
        parts.push(part);
        rest = tail;
    }
    let mine = parts.pop().expect("at least one thread");
    if threads == 1 {
        let mut scratch = make(mine);
        tasks.into_iter().for_each(|t| work(&mut scratch, t));
        return;
    }
    let queue = Mutex::new(tasks.into_iter());
    let worker = |part: &'w mut [f32]| {
        let mut scratch = make(part);
        loop {
            // The lock is held only while taking a task, never while working, so it cannot be
            // poisoned; a panicking task is re-raised by the scope after the join.
            let Some(task) = queue.lock().unwrap_or_else(|e| e.into_inner()).next() else { break };
            work(&mut scratch, task);
        }
    };
    let worker = &worker;
    std::thread::scope(|s| {
        for part in parts {
            s.spawn(move || worker(part));
        }
        worker(mine);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_with_its_own_output() {
        for threads in [0, 1, 2, 5, 64] {
            let mut out = vec![0u32; 40];
            let tasks: Vec<_> = out.chunks_mut(3).enumerate().collect();
            run(
                tasks,
                threads,
                || 0u32,
                |count, (i, chunk)| {
                    *count += 1;
                    chunk.fill(i as u32 + 1);
                },
            );
            let want: Vec<u32> = (0..40).map(|j| j / 3 + 1).collect();
            assert_eq!(out, want, "threads = {threads}");
        }
    }

    /// Each thread gets its own run of the workspace, and together they use all of it.
    #[test]
    fn each_thread_gets_its_own_part_of_the_workspace() {
        for threads in [1u32, 2, 3] {
            let tasks: Vec<usize> = (0..7).collect();
            let per = 4;
            let mut workspace = vec![0.0f32; workers(threads, tasks.len()) * per];
            run_in(
                tasks,
                threads,
                &mut workspace,
                per,
                |part| part,
                |part, _| {
                    assert_eq!(part.len(), per);
                    part[0] += 1.0;
                },
            );
            let counts: f32 = workspace.chunks(per).map(|c| c[0]).sum();
            assert_eq!(counts, 7.0, "threads = {threads}: {workspace:?}");
            assert!(workspace.chunks(per).all(|c| c[1..].iter().all(|&x| x == 0.0)));
        }
        assert_eq!((workers(0, 5), workers(8, 5), workers(2, 0)), (1, 5, 0));
    }

    /// Small passes stay whole; large ones split into equal shares of at least the minimum.
    #[test]
    fn elementwise_chunks_keep_small_passes_whole() {
        let min = MIN_ELEMENTS_PER_THREAD;
        assert_eq!(elementwise_chunk(0, 4), 1);
        assert_eq!(elementwise_chunk(100, 4), 100);
        assert_eq!(elementwise_chunk(2 * min - 1, 4), 2 * min - 1);
        assert_eq!(elementwise_chunk(2 * min, 4), min);
        assert_eq!(elementwise_chunk(3 * min + 1, 2), (3 * min + 2) / 2);
        assert_eq!(elementwise_chunk(10 * min, 4), 10 * min / 4);
        assert_eq!(elementwise_chunk(10 * min, 0), 10 * min);
    }
}
