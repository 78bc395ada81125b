// The CPU emulator's scheduler (see ava_emu.h): a launch runs its blocks one after another;
// a block's threads are fibers run one at a time, each until it reaches a barrier
// (`__syncthreads`), a warp-level operation or its end. A warp's waiting lanes go on when all
// its lanes wait; the block's when all its threads do. Threads that disagree (a warp split
// between two barriers, a shuffle with a lane gone) fail the launch with what happened, as
// does a dynamic shared memory request above a Hopper block's 227 KiB. A block runs in one
// of three orders (`ava_emu_launch`'s `order`): 0 lockstep (threads in index order, warps
// advancing together from one warp operation to the next), 1 serial (warp after warp, the
// first first, each run up to its next __syncthreads before the next starts) or 2 serial
// reversed (the last warp first, its lanes last first, and the blocks last first); a kernel
// whose output differs between them reads what another thread writes without a barrier
// between. Dynamic shared memory is 0xff bytes at each block's start; `__shared__` statics
// keep what the previous block left (they cannot be reached to be filled), and the reversed
// order runs the blocks last first, so that previous block is another one.
#include <sys/mman.h>
#include <ucontext.h>

#include <mutex>
#include <stdarg.h>
#include <stdio.h>
#include <vector>

#include "ava_emu.h"

namespace {

// Switching between fibers. On x86-64 a switch saves the callee-saved registers and the
// floating-point control words on the stack it leaves and restores the other's: no system
// call (ucontext's swapcontext saves the signal mask with one, each switch, which made the
// optimizers' tests take minutes). Elsewhere, ucontext.
#if defined(__x86_64__)
struct Context {
    void *sp = nullptr;
};
extern "C" void ava_emu_switch(void **from, void *to);
asm(R"(
    .text
    .p2align 4
    .globl ava_emu_switch
    .hidden ava_emu_switch
    .type ava_emu_switch, @function
ava_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size ava_emu_switch, .-ava_emu_switch
)");
void switch_to(Context &from, Context &to) { ava_emu_switch(&from.sp, to.sp); }
// A fresh context that starts `entry` (which never returns) on [stack, stack + size).
void start(Context &c, void *stack, size_t size, void (*entry)()) {
    uint64_t *sp = reinterpret_cast<uint64_t *>((reinterpret_cast<uintptr_t>(stack) + size) & ~(uintptr_t)15);
    *--sp = 0;                                     // entry's return address: it never returns
    *--sp = reinterpret_cast<uint64_t>(entry);     // where the first switch's `ret` goes
    for (int i = 0; i < 6; ++i) *--sp = 0;         // rbp, rbx, r12-r15
    uint32_t mxcsr;
    uint16_t fpucw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpucw));
    *--sp = (uint64_t)mxcsr | ((uint64_t)fpucw << 32); // this thread's control words
    c.sp = sp;
}
#else
struct Context {
    ucontext_t uc;
};
void switch_to(Context &from, Context &to) { swapcontext(&from.uc, &to.uc); }
void start(Context &c, void *stack, size_t size, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
#endif

constexpr size_t STACK = 512 << 10;         // bytes a fiber (mapped lazily)
constexpr size_t GUARD = 64 << 10;          // inaccessible bytes below each stack
constexpr size_t MAX_SHARED = 227u << 10;   // a Hopper block's dynamic shared memory
constexpr unsigned MAX_THREADS = 1024;

enum class State { Run, Warp, Block, Done };

struct Fiber {
    Context ctx;
    void *stack = nullptr;
    State state = State::Run;
    uint3 idx{};
    const void *post = nullptr; // the value posted for a warp exchange
    const char *op = nullptr;   // the warp operation it waits at
};

struct Launch {
    void (*body)(void *) = nullptr;
    void *ctx = nullptr;
    std::vector<Fiber> fibers;
    unsigned current = 0;
    Context scheduler;
    bool failed = false;
    char why[512] = {0};
    alignas(128) unsigned char shared[MAX_SHARED];
    size_t shared_bytes = 0;
    const void *slots[32];
};

std::mutex launches; // one launch at a time per library (the statics are shared)
Launch *now = nullptr;

void fail_with(const char *fmt, ...) {
    if (now->failed) return;
    now->failed = true;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(now->why, sizeof now->why, fmt, ap);
    va_end(ap);
}

// A fiber's first frame: the thread's body, then back to the scheduler for good.
void entry() {
    now->body(now->ctx);
    now->fibers[now->current].state = State::Done;
    switch_to(now->fibers[now->current].ctx, now->scheduler);
    __builtin_trap(); // a finished fiber is never resumed
}

// The running fiber stops in `state` (at warp operation `op`); the scheduler resumes it when
// its barrier opens.
void wait_in(State state, const char *op = nullptr) {
    Fiber &f = now->fibers[now->current];
    f.state = state;
    f.op = op;
    switch_to(f.ctx, now->scheduler);
}

// Warp w's lanes [lo, hi) when none is running: 1 when all that have not returned wait at one
// warp operation (they go on), 0 when some have yet to arrive (or wait at __syncthreads), -1
// when the launch fails: lanes at different warp operations, or some returned before it.
int open_warp(unsigned w, unsigned lo, unsigned hi) {
    auto &fs = now->fibers;
    unsigned warp = 0, done = 0, first = hi;
    for (unsigned i = lo; i < hi; ++i) {
        warp += fs[i].state == State::Warp, done += fs[i].state == State::Done;
        if (fs[i].state == State::Warp && first == hi) first = i;
    }
    if (warp == 0 || warp + done < hi - lo) return 0;
    if (done > 0) {
        fail_with("warp %u of block (%u, %u, %u): %u lanes wait at %s after %u of its lanes returned (the full mask "
                  "names them)",
                  w, ava_emu_block_idx.x, ava_emu_block_idx.y, ava_emu_block_idx.z, warp, fs[first].op, done);
        return -1;
    }
    for (unsigned i = lo; i < hi; ++i)
        if (strcmp(fs[i].op, fs[first].op) != 0) {
            fail_with("warp %u of block (%u, %u, %u): lane %u waits at %s, lane %u at %s (a warp's lanes must meet at "
                      "one warp operation)",
                      w, ava_emu_block_idx.x, ava_emu_block_idx.y, ava_emu_block_idx.z, first - lo, fs[first].op,
                      i - lo, fs[i].op);
            return -1;
        }
    // After an exchange's end no lane reads the values posted for it any more.
    const bool exchanged = strcmp(fs[first].op, AVA_EMU_EXCHANGED) == 0;
    for (unsigned i = lo; i < hi; ++i) {
        fs[i].state = State::Run;
        if (exchanged) fs[i].post = nullptr;
    }
    return 1;
}

// Opens the barriers whose threads have all arrived; false when none could open.
bool release() {
    auto &fs = now->fibers;
    const unsigned n = fs.size();
    bool opened = false;
    for (unsigned w = 0; w * 32 < n; ++w) {
        const unsigned lo = w * 32, hi = n < lo + 32 ? n : lo + 32;
        const int r = open_warp(w, lo, hi);
        if (r < 0) return false;
        opened |= r > 0;
    }
    if (opened) return true;
    unsigned block = 0, done = 0;
    for (auto &f : fs) block += f.state == State::Block, done += f.state == State::Done;
    if (block > 0 && block + done == n) {
        for (auto &f : fs)
            if (f.state == State::Block) f.state = State::Run;
        return true;
    }
    return false;
}

void describe_deadlock() {
    auto &fs = now->fibers;
    char states[256] = {0};
    size_t at = 0;
    for (unsigned w = 0; w * 32 < fs.size() && at + 64 < sizeof states; ++w) {
        unsigned lane_in[4] = {0, 0, 0, 0};
        for (unsigned i = w * 32; i < fs.size() && i < w * 32 + 32; ++i) lane_in[(int)fs[i].state]++;
        at += snprintf(states + at, sizeof states - at, " warp %u: %u at a warp op, %u at __syncthreads, %u done;", w,
                       lane_in[1], lane_in[2], lane_in[3]);
    }
    fail_with("block (%u, %u, %u) cannot go on: its threads wait at different barriers:%s", ava_emu_block_idx.x,
              ava_emu_block_idx.y, ava_emu_block_idx.z, states);
}

// Resumes fiber i until it waits or ends.
void resume(unsigned i) {
    now->current = i;
    ava_emu_thread_idx = now->fibers[i].idx;
    switch_to(now->scheduler, now->fibers[i].ctx);
}

bool all_done() {
    for (auto &f : now->fibers)
        if (f.state != State::Done) return false;
    return true;
}

// Lockstep: every runnable thread in index order, then the barriers that can open, until the
// block ends. Warps advance together from one warp-level operation to the next.
void run_lockstep() {
    auto &fs = now->fibers;
    const unsigned n = fs.size();
    while (!now->failed) {
        bool ran = false;
        for (unsigned i = 0; i < n && !now->failed; ++i)
            if (fs[i].state == State::Run) resume(i), ran = true;
        if (now->failed || all_done()) return;
        if (!release() && !ran) {
            if (!now->failed) describe_deadlock();
            return;
        }
    }
}

// Warp after warp (the first first, or with `reversed` the last first and its lanes last
// first), each run through all its warp-level operations up to the next __syncthreads before
// the next warp starts: a warp that reads shared memory another warp writes, without a
// barrier between, reads it before that warp has written it in one direction, or after that
// warp has moved on and written it again in the other (the lockstep order hides both).
void run_serial(bool reversed) {
    auto &fs = now->fibers;
    const unsigned n = fs.size(), warps = (n + 31) / 32;
    while (!now->failed) {
        for (unsigned wr = 0; wr < warps && !now->failed; ++wr) {
            const unsigned w = reversed ? warps - 1 - wr : wr, lo = w * 32, hi = n < lo + 32 ? n : lo + 32;
            while (!now->failed) {
                for (unsigned k = 0; k < hi - lo && !now->failed; ++k) {
                    const unsigned i = reversed ? hi - 1 - k : lo + k;
                    if (fs[i].state == State::Run) resume(i);
                }
                unsigned warp = 0;
                for (unsigned i = lo; i < hi; ++i) warp += fs[i].state == State::Warp;
                if (warp == 0) break; // every lane at __syncthreads or finished
                const int r = open_warp(w, lo, hi);
                if (r < 0) return;
                if (r == 0) { // lanes at a warp operation while others wait at __syncthreads
                    describe_deadlock();
                    return;
                }
            }
        }
        if (now->failed || all_done()) return;
        for (auto &f : fs)
            if (f.state == State::Block) f.state = State::Run;
    }
}

void run_block(int order) {
    auto &fs = now->fibers;
    memset(now->shared, 0xff, now->shared_bytes);
    for (auto &f : fs) {
        f.state = State::Run;
        f.post = nullptr;
        start(f.ctx, f.stack, STACK, entry);
    }
    if (order == 0) run_lockstep();
    else run_serial(order == 2);
}

} // namespace

extern "C" {

uint3 ava_emu_thread_idx, ava_emu_block_idx;
dim3 ava_emu_block_dim, ava_emu_grid_dim;

unsigned char *ava_emu_dynamic_shared() { return now->shared; }

int ava_emu_in_shared(const void *p, size_t n) {
    const unsigned char *c = static_cast<const unsigned char *>(p);
    return c >= now->shared && c + n <= now->shared + now->shared_bytes;
}

void ava_emu_sync_block() { wait_in(State::Block); }

void ava_emu_sync_warp(const char *op) { wait_in(State::Warp, op); }

const void *const *ava_emu_warp_post(const void *mine, const char *op) {
    auto &fs = now->fibers;
    fs[now->current].post = mine;
    wait_in(State::Warp, op);
    // Every lane has posted: copy the warp's addresses for this lane to read.
    const unsigned w = now->current / 32, n = fs.size();
    // One array for the whole launch: a lane reads it before its next switch, and every lane
    // fills it again when it resumes here.
    for (unsigned j = 0; j < 32; ++j) now->slots[j] = w * 32 + j < n ? fs[w * 32 + j].post : nullptr;
    return now->slots;
}

[[noreturn]] void ava_emu_fail(const char *why) {
    fail_with("thread (%u, %u, %u) of block (%u, %u, %u): %s", ava_emu_thread_idx.x, ava_emu_thread_idx.y,
              ava_emu_thread_idx.z, ava_emu_block_idx.x, ava_emu_block_idx.y, ava_emu_block_idx.z, why);
    Fiber &f = now->fibers[now->current];
    f.state = State::Done;
    switch_to(f.ctx, now->scheduler);
    __builtin_unreachable();
}

// Runs `body(ctx)` as every thread of a grid × block launch with `shared` bytes of dynamic
// shared memory. 0 when it ran; otherwise 1 and the reason in why (NUL-terminated).
int ava_emu_launch(const unsigned grid[3], const unsigned block[3], size_t shared, int order,
                   void (*body)(void *), void *ctx, char *why, size_t why_len) {
    std::lock_guard<std::mutex> guard(launches);
    static Launch *launch = new Launch();
    static std::vector<void *> stacks;
    const unsigned threads = block[0] * block[1] * block[2];
    auto refuse = [&](const char *msg) {
        snprintf(why, why_len, "%s", msg);
        return 1;
    };
    if (threads == 0 || threads > MAX_THREADS) return refuse("a block has 1 to 1024 threads");
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0) return refuse("a grid has at least one block each way");
    if (grid[1] > 65535 || grid[2] > 65535) return refuse("a grid's y and z are at most 65535");
    if (shared > MAX_SHARED) {
        snprintf(why, why_len, "%zu bytes of dynamic shared memory asked, a Hopper block has %zu", shared, MAX_SHARED);
        return 1;
    }
    while (stacks.size() < threads) {
        // A page below each stack that faults: a fiber that overflows its stack stops the
        // process there instead of writing over its neighbour's.
        void *s = mmap(nullptr, STACK + GUARD, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (s == MAP_FAILED) return refuse("could not map a fiber's stack");
        mprotect(s, GUARD, PROT_NONE);
        stacks.push_back(static_cast<unsigned char *>(s) + GUARD);
    }
    now = launch;
    now->failed = false;
    now->why[0] = 0;
    now->body = body;
    now->ctx = ctx;
    now->shared_bytes = shared;
    now->fibers.assign(threads, Fiber{});
    ava_emu_block_dim = dim3{block[0], block[1], block[2]};
    ava_emu_grid_dim = dim3{grid[0], grid[1], grid[2]};
    for (unsigned i = 0; i < threads; ++i) {
        now->fibers[i].stack = stacks[i];
        now->fibers[i].idx = uint3{i % block[0], (i / block[0]) % block[1], i / (block[0] * block[1])};
    }
    if (order < 0 || order > 2) return refuse("the order is 0 (lockstep), 1 (serial) or 2 (serial reversed)");
    // The reversed order also runs the blocks last first, so a block that reads a __shared__
    // static before writing it sees another neighbour's leftovers than in the other orders.
    const unsigned long long blocks = (unsigned long long)grid[0] * grid[1] * grid[2];
    for (unsigned long long k = 0; k < blocks && !now->failed; ++k) {
        const unsigned long long b = order == 2 ? blocks - 1 - k : k;
        ava_emu_block_idx = uint3{(unsigned)(b % grid[0]), (unsigned)(b / grid[0] % grid[1]),
                                  (unsigned)(b / ((unsigned long long)grid[0] * grid[1]))};
        run_block(order);
    }
    const int failed = now->failed;
    if (failed) snprintf(why, why_len, "%s", now->why);
    now = nullptr;
    return failed;
}
}
