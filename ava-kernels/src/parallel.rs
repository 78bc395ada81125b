//! Spreading a kernel's tasks over the threads the host grants.
//!
//! Every task owns the slices it writes, so results never depend on which thread ran a
//! task or in what order; only the task list (fixed by the shape) decides the arithmetic.
//! The threads are scoped and live for one call: plugins do not keep pools of their own.

use std::sync::Mutex;

/// Runs `work(&mut scratch, task)` on every task with at most `threads` threads, each
/// taking the next task from a shared queue (tasks of unequal cost balance themselves; put
/// the expensive ones first). `scratch` is made once per thread by `init`.
pub fn run<T: Send, S>(tasks: Vec<T>, threads: u32, init: impl Fn() -> S + Sync, work: impl Fn(&mut S, T) + Sync) {
    let threads = (threads.max(1) as usize).min(tasks.len());
    if threads <= 1 {
        let mut scratch = init();
        tasks.into_iter().for_each(|t| work(&mut scratch, t));
        return;
    }
    let queue = Mutex::new(tasks.into_iter());
    let worker = || {
        let mut scratch = init();
        loop {
            // The lock is held only while taking a task, never while working, so it cannot be
            // poisoned; a panicking task is re-raised by the scope after the join.
            let Some(task) = queue.lock().unwrap_or_else(|e| e.into_inner()).next() else { break };
            work(&mut scratch, task);
        }
    };
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(worker);
        }
        worker();
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
}
