// The emulator's scheduler: fibers, barriers, warp rendezvous, asynchronous copies and
// the checks that make a wrong kernel fail loudly. Included once, by the generated
// translation unit (tests/kernel_harness.py), after the kernels.
//
// Faithfulness, and what each device is for:
//   - Shared memory is filled with 0xFF (NaN in fp16, bf16 and fp32) before every block,
//     and the bytes past the launch's dynamic size must still be 0xFF after it: a read
//     before the data arrived, or past the end, poisons the result; a write past the end
//     fails the launch.
//   - Threads run warp-greedy: a warp runs until every lane blocks at a barrier, before
//     the next warp starts. The warp order (and the block order) is forward, reverse or a
//     seeded shuffle, chosen per launch; a missing __syncthreads then lets one warp
//     overwrite a tile that another has not read yet, or read one not yet written.
//   - cp.async copies land at the latest allowed moment (the thread's
//     cp.async.wait_group) or the earliest (when issued), chosen per launch: the first
//     catches a missing wait, the second a tile overwritten while others still read it.
//   - Reported as failures: deadlock, a barrier reached while other threads of the block
//     have exited (the GPU's behaviour there is undefined), divergent warp collectives,
//     a lane exiting while its warp waits for it, shared-memory accesses out of bounds or
//     misaligned.
//   - Not modelled: races between blocks on global memory (blocks run one at a time), and
//     the GPU's exact rounding in exp2 and in tensor-core accumulation.
#pragma once
#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

uint3 threadIdx;
uint3 blockIdx;
dim3 blockDim;
dim3 gridDim;

namespace emu {

constexpr size_t SMEM_CAP = EMU_SMEM_CAP;
constexpr size_t STACK_BYTES = 1 << 16;
constexpr int MAX_THREADS = 1024;

enum State { RUNNABLE, AT_BARRIER, AT_WARP, EXITED };

struct Fiber {
#if defined(__x86_64__)
    void* sp = nullptr;
#else
    ucontext_t ctx;
#endif
    State state = RUNNABLE;
    uint3 tid{};
    // cp.async: committed groups, oldest first, and the copies issued since the last commit.
    struct Copy { unsigned char* dst; unsigned char data[16]; };
    std::vector<std::vector<Copy>> groups;
    std::vector<Copy> open;
};

struct Warp {
    int arrived = 0;
    const char* name = nullptr;
    CollectiveFn fn = nullptr;
    Slot in[32], out[32];
};

struct Launch {
    void (*entry)(void**) = nullptr;
    void** args = nullptr;
    unsigned char* smem = nullptr;
    size_t smem_bytes = 0;
    int nthreads = 0;
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    std::vector<unsigned char> stacks;
    int current = -1;
    bool early_copies = false;
    bool failed = false;
    std::string error;
#if defined(__x86_64__)
    void* sched_sp = nullptr;
#else
    ucontext_t sched_ctx;
#endif
};

static Launch* g_launch = nullptr;

// ---- context switch ----------------------------------------------------------------------
#if defined(__x86_64__)
// Save the callee-saved registers and the stack pointer in *from, load them from `to`.
extern "C" void emu_switch_ctx(void** from, void* to);
asm(R"(
    .text
    .p2align 4
    .hidden emu_switch_ctx
    .globl emu_switch_ctx
    .type emu_switch_ctx, @function
emu_switch_ctx:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch_ctx, .-emu_switch_ctx
)");
#endif

static void to_scheduler() {
    Launch& L = *g_launch;
#if defined(__x86_64__)
    emu_switch_ctx(&L.fibers[L.current].sp, L.sched_sp);
#else
    swapcontext(&L.fibers[L.current].ctx, &L.sched_ctx);
#endif
}

static void resume(int t) {
    Launch& L = *g_launch;
    L.current = t;
    threadIdx = L.fibers[t].tid;
#if defined(__x86_64__)
    emu_switch_ctx(&L.sched_sp, L.fibers[t].sp);
#else
    swapcontext(&L.sched_ctx, &L.fibers[t].ctx);
#endif
}

static void fiber_main() {
    Launch& L = *g_launch;
    L.entry(L.args);
    L.fibers[L.current].state = EXITED;
    to_scheduler();
    std::abort();  // an exited fiber is never resumed
}

static void start_fiber(int t) {
    Launch& L = *g_launch;
    unsigned char* top = L.stacks.data() + (size_t)(t + 1) * STACK_BYTES;
#if defined(__x86_64__)
    // Six callee-saved registers, then the "return address" fiber_main, then a fake return
    // address for fiber_main itself: it then starts with rsp = 8 (mod 16), as after a call.
    auto* sp = reinterpret_cast<void**>(reinterpret_cast<uintptr_t>(top) & ~uintptr_t(15)) - 8;
    for (int i = 0; i < 6; ++i) sp[i] = nullptr;
    sp[6] = reinterpret_cast<void*>(&fiber_main);
    sp[7] = nullptr;
    L.fibers[t].sp = sp;
#else
    ucontext_t& c = L.fibers[t].ctx;
    getcontext(&c);
    c.uc_stack.ss_sp = top - STACK_BYTES;
    c.uc_stack.ss_size = STACK_BYTES;
    c.uc_link = nullptr;
    makecontext(&c, fiber_main, 0);
#endif
}

// ---- failures ------------------------------------------------------------------------------
void fail(const char* fmt, ...) {
    Launch& L = *g_launch;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    char where[128];
    snprintf(where, sizeof where, "block (%u,%u,%u) thread %d: ", blockIdx.x, blockIdx.y, blockIdx.z, L.current);
    if (!L.failed) L.error = std::string(where) + msg;
    L.failed = true;
    to_scheduler();
    std::abort();
}

void check_smem(const void* p, int bytes, int align, const char* what) {
    Launch& L = *g_launch;
    auto a = reinterpret_cast<uintptr_t>(p), base = reinterpret_cast<uintptr_t>(L.smem);
    if (a < base || a + bytes > base + L.smem_bytes)
        fail("%s: address is %+lld bytes from the dynamic shared memory (size %zu)", what,
             (long long)(a - base), L.smem_bytes);
    if (a % align) fail("%s: shared address %llu is not %d-byte aligned", what, (unsigned long long)(a - base), align);
}

// ---- synchronisation ---------------------------------------------------------------------
Slot collective(const char* name, CollectiveFn fn, const Slot& in) {
    Launch& L = *g_launch;
    const int t = L.current, lane = t % 32;
    Warp& w = L.warps[t / 32];
    if (w.arrived == 0) {
        w.name = name;
        w.fn = fn;
    } else if (std::strcmp(w.name, name) != 0) {
        fail("divergent warp collectives: lane %d at %s while other lanes wait at %s", lane, name, w.name);
    }
    w.in[lane] = in;
    if (++w.arrived == 32) {
        w.arrived = 0;
        w.fn(w.in, w.out);
        const int first = (t / 32) * 32;
        for (int i = first; i < first + 32; ++i)
            if (L.fibers[i].state == AT_WARP) L.fibers[i].state = RUNNABLE;
    } else {
        L.fibers[t].state = AT_WARP;
        to_scheduler();
    }
    return w.out[lane];
}

static void apply(std::vector<Fiber::Copy>& copies) {
    for (auto& c : copies) std::memcpy(c.dst, c.data, 16);
}

void cp_async(void* dst, const void* src, bool valid) {
    check_smem(dst, 16, 16, "cp.async destination");
    Fiber& f = g_launch->fibers[g_launch->current];
    Fiber::Copy c;
    c.dst = static_cast<unsigned char*>(dst);
    if (valid) {
        if (reinterpret_cast<uintptr_t>(src) % 16) fail("cp.async: global source is not 16-byte aligned");
        std::memcpy(c.data, src, 16);  // global memory does not change during a launch
    } else {
        std::memset(c.data, 0, 16);
    }
    if (g_launch->early_copies)
        std::memcpy(c.dst, c.data, 16);
    else
        f.open.push_back(c);
}

void cp_commit() {
    Fiber& f = g_launch->fibers[g_launch->current];
    f.groups.push_back(std::move(f.open));
    f.open.clear();
}

void cp_wait(int allowed) {
    Fiber& f = g_launch->fibers[g_launch->current];
    while ((int)f.groups.size() > allowed) {
        apply(f.groups.front());
        f.groups.erase(f.groups.begin());
    }
}

}  // namespace emu

void __syncthreads() {
    emu::Launch& L = *emu::g_launch;
    L.fibers[L.current].state = emu::AT_BARRIER;
    emu::to_scheduler();
}

static void syncwarp_fn(const emu::Slot*, emu::Slot*) {}
void __syncwarp(unsigned mask) {
    if (mask != 0xffffffffu) emu::fail("__syncwarp: only full-warp masks are emulated, got %#x", mask);
    emu::collective("__syncwarp", syncwarp_fn, emu::Slot{});
}

namespace emu {

// Run one block to completion, or until a failure. Returns false on failure.
static bool run_block(const std::vector<int>& warp_order, bool lanes_reversed) {
    Launch& L = *g_launch;
    std::memset(L.smem, 0xFF, SMEM_CAP);
    for (int t = 0; t < L.nthreads; ++t) {
        Fiber& f = L.fibers[t];
        f.state = RUNNABLE;
        f.tid = {(unsigned)(t % blockDim.x), (unsigned)(t / blockDim.x % blockDim.y),
                 (unsigned)(t / (blockDim.x * blockDim.y))};
        f.groups.clear();
        f.open.clear();
        start_fiber(t);
    }
    for (auto& w : L.warps) w.arrived = 0;
    for (;;) {
        for (int w : warp_order) {
            // Warp-greedy: keep running this warp's lanes until none of them can move.
            for (bool moved = true; moved;) {
                moved = false;
                for (int i = 0; i < 32; ++i) {
                    const int t = w * 32 + (lanes_reversed ? 31 - i : i);
                    if (t >= L.nthreads || L.fibers[t].state != RUNNABLE) continue;
                    resume(t);
                    if (L.failed) return false;
                    moved = true;
                }
            }
        }
        int exited = 0, at_barrier = 0, at_warp = 0;
        for (int t = 0; t < L.nthreads; ++t) {
            exited += L.fibers[t].state == EXITED;
            at_barrier += L.fibers[t].state == AT_BARRIER;
            at_warp += L.fibers[t].state == AT_WARP;
        }
        L.current = -1;
        if (exited == L.nthreads) break;
        if (at_warp) {
            for (int t = 0; t < L.nthreads; ++t)
                if (L.fibers[t].state == AT_WARP) {
                    L.current = t;
                    L.error = "warp collective '" + std::string(L.warps[t / 32].name) +
                              "' never completed: a lane of warp " + std::to_string(t / 32) +
                              " exited or waits at __syncthreads instead";
                    break;
                }
            L.failed = true;
            return false;
        }
        if (exited) {
            L.failed = true;
            L.error = std::to_string(at_barrier) + " threads wait at __syncthreads while " +
                      std::to_string(exited) + " have exited (only whole-block early returns are allowed)";
            return false;
        }
        for (int t = 0; t < L.nthreads; ++t) L.fibers[t].state = RUNNABLE;  // barrier complete
    }
    const unsigned char* tail = L.smem + L.smem_bytes;
    for (size_t i = 0; i < SMEM_CAP - L.smem_bytes; ++i)
        if (tail[i] != 0xFF) {
            L.failed = true;
            L.error = "shared memory written " + std::to_string(i) + " bytes past the launch's dynamic size";
            return false;
        }
    return true;
}

}  // namespace emu

// order & 3: 0 forward, 1 reverse, 2 seeded shuffle (warps and blocks), 3 the shuffle with
// lanes reversed; order & 4: cp.async copies land when issued instead of at the wait.
static int emu_run(void (*entry)(void**), void** args, unsigned char* smem, const dim3& grid,
                   const dim3& block, size_t shmem, int order, unsigned seed, char* err, size_t errlen) {
    emu::Launch L;
    emu::g_launch = &L;
    auto failure = [&](const std::string& msg) {
        snprintf(err, errlen, "%s", msg.c_str());
        emu::g_launch = nullptr;
        return 1;
    };
    L.nthreads = (int)(block.x * block.y * block.z);
    if (L.nthreads < 1 || L.nthreads > emu::MAX_THREADS) return failure("bad block size");
    if (shmem > emu::SMEM_CAP) return failure("dynamic shared memory " + std::to_string(shmem) + " bytes > 227 KiB");
    L.entry = entry;
    L.args = args;
    L.early_copies = (order & 4) != 0;
    order &= 3;
    L.smem = smem;
    L.smem_bytes = shmem;
    L.fibers.resize(L.nthreads);
    L.warps.resize((L.nthreads + 31) / 32);
    L.stacks.resize((size_t)L.nthreads * emu::STACK_BYTES);
    if (L.nthreads % 32) return failure("block size must be a multiple of 32");
    gridDim = grid;
    blockDim = block;
    std::mt19937 rng(seed);
    const long long nblocks = (long long)grid.x * grid.y * grid.z;
    std::vector<long long> blocks(nblocks);
    for (long long i = 0; i < nblocks; ++i) blocks[i] = order == 1 ? nblocks - 1 - i : i;
    if (order >= 2) std::shuffle(blocks.begin(), blocks.end(), rng);
    std::vector<int> warps(L.warps.size());
    for (size_t i = 0; i < warps.size(); ++i) warps[i] = order == 1 ? (int)(warps.size() - 1 - i) : (int)i;
    for (long long bid : blocks) {
        blockIdx = {(unsigned)(bid % grid.x), (unsigned)(bid / grid.x % grid.y), (unsigned)(bid / ((long long)grid.x * grid.y))};
        if (order >= 2) std::shuffle(warps.begin(), warps.end(), rng);
        if (!emu::run_block(warps, order == 3)) {
            char where[96];
            snprintf(where, sizeof where, "block (%u,%u,%u): ", blockIdx.x, blockIdx.y, blockIdx.z);
            std::string msg = L.error.rfind("block", 0) == 0 ? L.error : where + L.error;
            return failure(msg);
        }
    }
    emu::g_launch = nullptr;
    return 0;
}
