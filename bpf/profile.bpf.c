/* Stack sampler: runs on every CPU at each perf-event tick.
 *
 * Per sample it records the kernel stack (stack map), the user stack by a
 * frame-pointer walk that keeps every frame's stack address (so trampoline
 * frames found by other means can be merged in call order later), and counts
 * the (process, kernel stack, user stack) triple in a hash map. Only unique
 * stacks cross to user space.
 *
 * Double buffering: the daemon flips config.active_buffer, waits for running
 * programs to finish, then drains the other buffer while this program keeps
 * writing the new one. Count and user-stack keys carry the buffer number;
 * kernel stacks have one stack map per buffer.
 *
 * Kernel struct fields are read at offsets from the running kernel's BTF,
 * passed in as -D constants (TP_OFF_*), never from compiled-in headers.
 */
#include <uapi/linux/bpf_perf_event.h>
#include <linux/sched.h>
#include "tramprof.h"

#ifndef TP_MAX_KEYS
#define TP_MAX_KEYS 16384
#endif
#ifndef TP_MAX_USTACKS
#define TP_MAX_USTACKS 16384
#endif
#ifndef TP_MAX_KSTACKS
#define TP_MAX_KSTACKS 8192
#endif
#ifndef TP_MAX_SEEN
#define TP_MAX_SEEN 16384
#endif
#ifndef TP_MAX_CHAIN_PROCS
#define TP_MAX_CHAIN_PROCS 4096
#endif
#ifndef TP_MAX_STUB_PAGES
#define TP_MAX_STUB_PAGES 65536
#endif
#ifndef TP_MAX_TARGETS
#define TP_MAX_TARGETS 4096
#endif
/* Stack window scanned for trampoline return addresses ("scan" mode), bytes
 * from the sampled sp upward; a multiple of the chunk size. */
#ifndef TP_SCAN_BYTES
#define TP_SCAN_BYTES 65536
#endif
#define TP_SCAN_CHUNK_WORDS 64
#define TP_SCAN_CHUNK_BYTES (TP_SCAN_CHUNK_WORDS * 8)
#define TP_SCAN_CHUNKS (TP_SCAN_BYTES / TP_SCAN_CHUNK_BYTES)
/* Chunks scanned per run of the scan program: each run is verified on its own
 * (the verifier walks every iteration of a bounded loop) and tail-calls the
 * next, so the window is not limited by the verifier's budget. */
#define TP_SCAN_CHUNKS_PER_RUN 16
#define TP_SCAN_RUNS ((TP_SCAN_CHUNKS + TP_SCAN_CHUNKS_PER_RUN - 1) / TP_SCAN_CHUNKS_PER_RUN)
/* Candidates examined per chunk; a Python frame takes far more than 64
 * bytes of native stack. */
#ifndef TP_SCAN_HITS_PER_CHUNK
#define TP_SCAN_HITS_PER_CHUNK 8
#endif

#define TP_PF_KTHREAD 0x00200000

struct tp_count_key {
    struct tp_sample_key sample;
    __u32 buffer;
    __u32 pad;
};

/* Per-CPU state of one stack scan. The hit count and page cache live here,
 * not in registers: the verifier then need not tell apart loop states that
 * differ only in them. */
struct tp_scan_scratch {
    __u64 last_page;
    __u32 n;
    __u32 pad;      /* 1: chain full, stop */
    __u64 stale;    /* stub return addresses without a live caller */
};

/* A sample handed from on_sample to the scan program's runs (tail calls
 * keep the CPU, so a per-CPU slot carries it). */
struct tp_pending {
    struct tp_count_key key;
    __u64 hash;
    __u64 check;
    __u64 sp;
    __u32 run;      /* next run: scans chunks [run * PER_RUN, (run + 1) * PER_RUN) */
    __u32 pad;
};

/* Per-CPU copy of one page of the sampled thread's stack: consecutive chain
 * records lie a few hundred bytes apart, so one page read serves several. */
struct tp_stack_page {
    __u64 words[512];
};

struct tp_ustack_key {
    __u64 hash;
    __u32 buffer;
    __u32 pad;
};

BPF_ARRAY(config, struct tp_config, 1);
BPF_HASH(target_pids, __u32, __u8, TP_MAX_TARGETS);
BPF_PERCPU_ARRAY(counters, __u64, TP_CNT_MAX);
BPF_PERCPU_ARRAY(scratch, struct tp_user_stack, 1);
BPF_HASH(counts, struct tp_count_key, __u64, TP_MAX_KEYS);
BPF_F_TABLE("hash", struct tp_ustack_key, struct tp_user_stack, ustacks, TP_MAX_USTACKS,
            BPF_F_NO_PREALLOC);
BPF_HASH(chain_procs, __u32, struct tp_chain_proc, TP_MAX_CHAIN_PROCS);
BPF_HASH(scan_procs, __u32, struct tp_scan_proc, TP_MAX_CHAIN_PROCS);
BPF_PERCPU_ARRAY(scan_scratch, struct tp_scan_scratch, 1);
BPF_PERCPU_ARRAY(stack_copy, struct tp_stack_page, 1);
BPF_PERCPU_ARRAY(pending, struct tp_pending, 1);
BPF_PROG_ARRAY(scan_programs, 1);
BPF_HASH(stub_pages, struct tp_stub_page, __u64, TP_MAX_STUB_PAGES);
BPF_TABLE("lru_hash", struct tp_process_seen, __u8, seen_processes, TP_MAX_SEEN);
BPF_PERF_OUTPUT(new_processes);
BPF_STACK_TRACE(kstacks0, TP_MAX_KSTACKS);
BPF_STACK_TRACE(kstacks1, TP_MAX_KSTACKS);

static __always_inline void bump(__u32 counter)
{
    __u64 *value = counters.lookup(&counter);
    if (value)
        *value += 1; /* per-CPU slot: no atomics needed */
}

static __always_inline __u64 read_u64(const void *addr)
{
    __u64 value = 0;
    bpf_probe_read_kernel(&value, sizeof(value), addr);
    return value;
}

/* Mixing steps of two independent 64-bit hashes over the return addresses. */
static __always_inline __u64 mix_a(__u64 h, __u64 v)
{
    h = (h ^ v) * 0x9E3779B97F4A7C15ULL;
    return h ^ (h >> 29);
}

static __always_inline __u64 mix_b(__u64 h, __u64 v)
{
    h = (h + v) * 0xC2B2AE3D27D4EB4FULL;
    return (h << 31) | (h >> 33);
}

/* User registers at the moment of the sample: the interrupted registers in
 * user mode, the task's saved user registers when the sample hit the kernel. */
static __always_inline int user_regs(struct bpf_perf_event_data *ctx, __u64 *ip, __u64 *sp,
                                     __u64 *bp)
{
    __u64 pc = PT_REGS_IP(&ctx->regs);
    if (!(pc >> 63)) {
        *ip = pc;
        *sp = PT_REGS_SP(&ctx->regs);
        *bp = PT_REGS_FP(&ctx->regs);
        return 0;
    }
    struct task_struct *task = bpf_get_current_task_btf();
    void *regs = (void *)bpf_task_pt_regs(task);
    if (!regs)
        return -1;
    *ip = read_u64(regs + TP_OFF_PT_REGS_IP);
    *sp = read_u64(regs + TP_OFF_PT_REGS_SP);
    *bp = read_u64(regs + TP_OFF_PT_REGS_BP);
    return *ip ? 0 : -1;
}

/* The two words at `at` (8-aligned) of the sampled thread's stack: a frame
 * record {caller fp, return address} or a chain record {prev, self}. Read
 * through a page copy: a user-memory read costs about the same for 16 bytes
 * as for a page, and consecutive records lie a few hundred bytes apart, so a
 * page is read once and the records in it are taken from the copy. A pair
 * that straddles pages, or a page that cannot be read whole, is read
 * directly. `*copied` is the page in the copy (0: none). */
static __always_inline int stack_pair(struct tp_stack_page *copy, __u64 *copied, __u64 at,
                                      __u64 record[2])
{
    __u64 page = at & ~0xFFFULL;
    __u32 idx = (at & 0xFFF) >> 3;
    if (idx <= 510) {
        if (page != *copied &&
            bpf_probe_read_user(copy->words, sizeof(copy->words), (void *)page) == 0)
            *copied = page;
        if (page == *copied) {
            record[0] = copy->words[idx];
            record[1] = copy->words[idx + 1];
            return 0;
        }
    }
    return bpf_probe_read_user(record, 16, (void *)at);
}

/* Frame-pointer walk. Each record at fp holds (caller's fp, return address);
 * the stack grows down, so every caller's record lies above the callee's. */
static __always_inline void walk_user(struct tp_user_stack *st, struct tp_stack_page *copy,
                                      __u64 *copied, __u64 ip, __u64 sp, __u64 fp, __u64 *hash)
{
    __u64 h = mix_a(0, ip), check = mix_b(0, ip);
    __u64 prev = sp;
    __u32 n = 1;

    st->frames[0].ip = ip;
    st->frames[0].sp = sp;
    st->flags = 0;

#pragma unroll 1
    for (int i = 1; i < TP_MAX_FRAMES; i++) {
        if (fp == 0)
            break;
        if (fp < prev || (fp & 7)) {
            st->flags |= TP_USTACK_FAULT;
            break;
        }
        __u64 record[2];
        if (stack_pair(copy, copied, fp, record)) {
            st->flags |= TP_USTACK_FAULT;
            break;
        }
        if (record[1] == 0)
            break;
        st->frames[i].ip = record[1];
        st->frames[i].sp = fp;
        h = mix_a(h, record[1]);
        check = mix_b(check, record[1]);
        n = i + 1;
        prev = fp + 16;
        fp = record[0];
    }
    if (n >= TP_MAX_FRAMES && fp != 0)
        st->flags |= TP_USTACK_TRUNCATED;
    st->nr = n;
    st->check = check;
    *hash = h;
}

/* Trampoline chain walk (processes running our runtime, trampolines/ABI.md):
 * the thread's chain head sits at a fixed offset from its thread pointer
 * (fs base); each record {prev, self} lies in a stub's frame. Every record is
 * validated: above the previous one on the stack, and `self` an exact stub
 * start inside one of the process's arenas. No frame pointers needed. */
static __always_inline int walk_chain(struct tp_user_stack *st, struct tp_stack_page *copy,
                                      __u64 *copied, __u32 tgid, void *task, __u64 *hash,
                                      __u64 *check)
{
    st->nr_chain = 0;
    struct tp_chain_proc *proc = chain_procs.lookup(&tgid);
    if (!proc || proc->stub_stride == 0)
        return 0;
    __u64 fsbase = read_u64(task + TP_OFF_TASK_FSBASE);
    __u64 head = 0;
    if (bpf_probe_read_user(&head, sizeof(head), (void *)(fsbase + proc->tls_offset))) {
        st->flags |= TP_CHAIN_INVALID;
        return 1;
    }
    __u64 h = *hash, c = *check, below = 0;
    __u32 n = 0;
    struct tp_stub_page page = {.tgid = tgid};
    __u64 last_page = 0, last_arena = 0; /* recursion reuses one stub: skip lookups */

#pragma unroll 1
    for (int i = 0; i < TP_MAX_CHAIN; i++) {
        if (head == 0)
            break;
        if (head <= below || (head & 7)) {
            st->flags |= TP_CHAIN_INVALID;
            break;
        }
        __u64 record[2];
        if (stack_pair(copy, copied, head, record)) {
            st->flags |= TP_CHAIN_INVALID;
            break;
        }
        __u64 stub = record[1];
        if ((stub & ~0xFFFULL) != last_page) {
            page.page = stub & ~0xFFFULL;
            __u64 *arena = stub_pages.lookup(&page);
            if (!arena) {
                st->flags |= TP_CHAIN_INVALID;
                break;
            }
            last_page = page.page;
            last_arena = *arena;
        }
        if (stub < last_arena || (stub - last_arena) % proc->stub_stride) {
            st->flags |= TP_CHAIN_INVALID;
            break;
        }
        st->chain[i & (TP_MAX_CHAIN - 1)].ip = stub;
        st->chain[i & (TP_MAX_CHAIN - 1)].sp = head;
        h = mix_a(h, stub);
        c = mix_b(c, stub);
        n = i + 1;
        below = head;
        head = record[0];
    }
    if (n >= TP_MAX_CHAIN && head != 0)
        st->flags |= TP_CHAIN_TRUNCATED;
    st->nr_chain = n;
    *hash = h;
    *check = c;
    return 1;
}

/* One candidate word of the stack scan: keep it when its page is an arena
 * page of this process. sc->pad set: TP_MAX_CHAIN frames taken. */
static __always_inline void scan_hit(struct tp_user_stack *st, struct tp_scan_scratch *sc,
                                  struct tp_stub_page *page, __u64 w, __u64 roff,
                                  __u64 where, int live, __u64 *h, __u64 *c)
{
    __u64 pg = w & ~0xFFFULL;
    if (pg != sc->last_page) {
        page->page = pg;
        if (!stub_pages.lookup(page))
            return;
        sc->last_page = pg;
    }
    __u32 n = sc->n;
    if (n >= TP_MAX_CHAIN) { /* the rest of the chunk is skipped too */
        st->flags |= TP_CHAIN_TRUNCATED;
        sc->pad = 1;
        return;
    }
    /* A stale word (live == 0) is written past the end and not counted:
     * without a branch, which the verifier pays for on every path. */
    __u64 stub = w - roff;
    __u64 keep = -(__u64)live;
    st->chain[n & (TP_MAX_CHAIN - 1)].ip = stub;
    st->chain[n & (TP_MAX_CHAIN - 1)].sp = where;
    sc->n = n + live;
    sc->stale += 1 - live;
    *h = (mix_a(*h, stub) & keep) | (*h & ~keep);
    *c = (mix_b(*c, stub) & keep) | (*c & ~keep);
}

/* 1 when w may be a stub's return address: in the arenas' range and at the
 * return offset of its stride slot. Both tests are borrow bits, without
 * branches: x < span iff bit 63 of (x - span) & ~x, y == 0 iff bit 63 of
 * (y - 1) & ~y. */
static __always_inline __u64 candidate_bit(__u64 w, __u64 lo, __u64 span, __u64 smask,
                                           __u64 roff)
{
    __u64 x = w - lo;
    __u64 y = (w & smask) ^ roff;
    return (((x - span) & ~x) & ((y - 1) & ~y)) >> 63;
}

/* Stack scan (stubs we do not control: CPython 3.12+ -X perf). Reads the user
 * stack from sp upward in chunks and takes every word that is a stub's return
 * address (see struct tp_scan_proc) as a trampoline frame: ip = the stub's
 * start (its perf map key), sp = the word's address. Lowest address first,
 * i.e. innermost first. Stops at the first unreadable chunk (the stack's top,
 * or a guard page) or at the window's end (flagged TP_SCAN_TRUNCATED). Words
 * below sp are dead and ignored. One call scans the chunks of run `run`;
 * returns 1 when the scan is over, 0 when the next run should go on. */
static __always_inline int scan_run(struct tp_user_stack *st, struct tp_scan_scratch *sc,
                                    struct tp_stack_page *copy, struct tp_scan_proc *proc,
                                    __u32 tgid, __u64 sp, __u32 run, __u64 *hash,
                                    __u64 *check)
{
    __u64 lo = proc->arena_min, span = proc->arena_span;
    __u64 smask = proc->stride_mask, roff = proc->return_offset;
    __u64 cmin = proc->caller_min, cspan = proc->caller_span;
    __u32 cwords = (proc->caller_offset >> 3) & 31;
    __u32 phase = proc->word_phase, odd = (phase >> 1) & 1;
    __u64 h = *hash, c = *check;
    struct tp_stub_page page = {.tgid = tgid};
    /* Chunks are aligned to their size, so never straddle a page; the stack
     * is read a page at a time and the scan stops at the first page that
     * cannot be read. */
    __u64 base = sp & ~(__u64)(TP_SCAN_CHUNK_BYTES - 1);
    __u64 first = (__u64)(run & 0xFFFF) * TP_SCAN_CHUNKS_PER_RUN;
    __u64 copied = 0; /* the page in `copy`: one user read per page, not per chunk */
    int over = 0;

#pragma unroll 1
    for (int i = 0; i < TP_SCAN_CHUNKS_PER_RUN; i++) {
        __u64 k = first + i;
        if (k >= TP_SCAN_CHUNKS) {
            /* Window used up: is there more stack above it? */
            __u64 more = 0;
            if (!bpf_probe_read_user(&more, sizeof(more),
                                     (void *)(base + (__u64)TP_SCAN_CHUNKS * TP_SCAN_CHUNK_BYTES)))
                st->flags |= TP_SCAN_TRUNCATED;
            over = 1;
            break;
        }
        __u64 addr = base + k * TP_SCAN_CHUNK_BYTES;
        __u64 pg = addr & ~0xFFFULL;
        if (pg != copied) {
            if (bpf_probe_read_user(copy->words, sizeof(copy->words), (void *)pg)) {
                over = 1;
                break;
            }
            copied = pg;
        }
        /* This chunk's first word in the page copy. */
        __u32 at = ((addr & 0xFFF) >> 3) & (512 - TP_SCAN_CHUNK_WORDS);
        /* Pass 1, without branches (the verifier's pending-branch budget is
         * per path): a bit per candidate word. */
        __u64 bits = 0;
        __u64 *cw = &copy->words[at];
        if (phase) {
            /* Return addresses only at every other word (see word_phase). */
#pragma unroll 1
            for (int pair = 0; pair < TP_SCAN_CHUNK_WORDS / 2; pair++) {
                __u32 j = (2 * pair + odd) & (TP_SCAN_CHUNK_WORDS - 1);
                bits |= candidate_bit(cw[j], lo, span, smask, roff) << j;
            }
        } else {
#pragma unroll 1
            for (int j = 0; j < TP_SCAN_CHUNK_WORDS; j++)
                bits |= candidate_bit(cw[j], lo, span, smask, roff) << j;
        }
        if (k == 0) /* words below sp are dead */
            bits &= ~0ULL << ((sp - addr) >> 3);
        /* Pass 2: the candidates, lowest address first. */
#pragma unroll 1
        for (int t = 0; t < TP_SCAN_HITS_PER_CHUNK; t++) {
            if (!bits)
                break;
            __u64 below = (bits & -bits) - 1; /* index = popcount(below) */
            below = below - ((below >> 1) & 0x5555555555555555ULL);
            below = (below & 0x3333333333333333ULL) + ((below >> 2) & 0x3333333333333333ULL);
            below = (below + (below >> 4)) & 0x0F0F0F0F0F0F0F0FULL;
            __u32 j = ((below * 0x0101010101010101ULL) >> 56) & (TP_SCAN_CHUNK_WORDS - 1);
            /* Is the stub's caller still there? A stale return address left
             * in a live C frame has usually lost it. (A caller word on the
             * next page is not checked.) */
            __u32 cj = at + j + cwords;
            __u64 cx = copy->words[cj & 511] - cmin;
            int live = ((((cx - cspan) & ~cx) >> 63) | (cj >> 9) | !cwords) & 1;
            scan_hit(st, sc, &page, cw[j], roff, addr + j * 8, live, &h, &c);
            bits &= bits - 1;
        }
        if (bits)
            st->flags |= TP_CHAIN_INVALID; /* more candidates than pass 2 takes */
        if (sc->pad) {
            over = 1;
            break;
        }
    }
    st->nr_chain = sc->n;
    *hash = h;
    *check = c;
    return over;
}

/* The end of every sample with a user stack: store the stack (deduplicated by
 * hash), announce a new process, count. */
static __always_inline int finish_sample(struct bpf_perf_event_data *ctx,
                                         struct tp_count_key *key, struct tp_user_stack *st,
                                         __u64 hash, __u64 check, int mode)
{
    st->check = check;
    hash |= 1; /* never 0: 0 means "no user stack" */
    if (st->nr_chain)
        bump(mode);
    if (st->flags & TP_SCAN_TRUNCATED)
        bump(TP_CNT_SCAN_TRUNCATED);
    if (st->flags & TP_CHAIN_TRUNCATED)
        bump(TP_CNT_CHAIN_TRUNCATED);
    if (st->flags & TP_CHAIN_INVALID)
        bump(TP_CNT_CHAIN_INVALID);
    if (st->flags & TP_USTACK_FAULT)
        bump(TP_CNT_USTACK_FAULT);
    if (st->flags & TP_USTACK_TRUNCATED)
        bump(TP_CNT_USTACK_TRUNCATED);

    struct tp_ustack_key skey = {.hash = hash, .buffer = key->buffer};
    struct tp_user_stack *stored = ustacks.lookup(&skey);
    if (stored) {
        if (stored->check != st->check || stored->nr != st->nr ||
            stored->nr_chain != st->nr_chain) {
            bump(TP_CNT_LOST_USTACK_COLLISION);
            return 0;
        }
    } else if (ustacks.update(&skey, st) != 0) {
        bump(TP_CNT_LOST_USTACKS_FULL);
        return 0;
    }
    key->sample.ustack_hash = hash;

    struct tp_process_seen seen = {.tgid = key->sample.tgid,
                                   .start_boottime = key->sample.start_boottime,
                                   .exec_id = key->sample.exec_id};
    if (!seen_processes.lookup(&seen)) {
        __u8 yes = 1;
        seen_processes.update(&seen, &yes);
        new_processes.perf_submit(ctx, &seen, sizeof(seen));
    }
    return 1;
}

static __always_inline int count_sample(struct tp_count_key *key)
{
    __u64 one = 1;
    __u64 *count = counts.lookup(key);
    if (count) {
        __sync_fetch_and_add(count, 1);
    } else if (counts.update(key, &one) != 0) {
        /* Another CPU may have inserted the key meanwhile; retry once. */
        count = counts.lookup(key);
        if (!count) {
            bump(TP_CNT_LOST_COUNTS_FULL);
            return 0;
        }
        __sync_fetch_and_add(count, 1);
    }
    bump(TP_CNT_RECORDED);
    return 0;
}

/* One run of the stack scan, tail-called by on_sample and by itself. */
int scan_step(struct bpf_perf_event_data *ctx)
{
    __u32 zero = 0;
    struct tp_pending *p = pending.lookup(&zero);
    struct tp_user_stack *st = scratch.lookup(&zero);
    struct tp_scan_scratch *sc = scan_scratch.lookup(&zero);
    struct tp_stack_page *copy = stack_copy.lookup(&zero);
    if (!p || !st || !sc || !copy)
        return 0;
    __u32 tgid = p->key.sample.tgid;
    struct tp_scan_proc *proc = scan_procs.lookup(&tgid);
    int over = 1;
    if (proc)
        over = scan_run(st, sc, copy, proc, tgid, p->sp, p->run, &p->hash, &p->check);
    if (!over) {
        p->run += 1;
        scan_programs.call(ctx, 0);
        /* Tail call refused (the chain of calls is at its limit): keep what
         * was found. */
        st->flags |= TP_SCAN_TRUNCATED;
    }
    if (sc->stale) {
        __u32 counter = TP_CNT_SCAN_STALE;
        __u64 *value = counters.lookup(&counter);
        if (value)
            *value += sc->stale;
    }
    if (finish_sample(ctx, &p->key, st, p->hash, p->check, TP_CNT_SCAN_SAMPLES))
        return count_sample(&p->key);
    return 0;
}

int on_sample(struct bpf_perf_event_data *ctx)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tgid = pid_tgid >> 32;
    __u32 zero = 0;

    bump(TP_CNT_SAMPLES);
    if (tgid == 0) {
        bump(TP_CNT_IDLE);
        return 0;
    }
    struct tp_config *cfg = config.lookup(&zero);
    if (!cfg)
        return 0;
    if (cfg->filter_pids && !target_pids.lookup(&tgid)) {
        bump(TP_CNT_FILTERED);
        return 0;
    }
    __u32 buffer = cfg->active_buffer & 1;

    struct tp_count_key key = {};
    key.buffer = buffer;
    key.sample.tgid = tgid;
    bpf_get_current_comm(&key.sample.comm, sizeof(key.sample.comm));

    void *task = (void *)bpf_get_current_task();
    void *leader = (void *)read_u64(task + TP_OFF_TASK_GROUP_LEADER);
    key.sample.start_boottime = read_u64(leader + TP_OFF_TASK_START_BOOTTIME);
#if TP_SIZE_TASK_SELF_EXEC_ID == 8
    key.sample.exec_id = read_u64(leader + TP_OFF_TASK_SELF_EXEC_ID);
#else
    __u32 exec_id32 = 0;
    bpf_probe_read_kernel(&exec_id32, sizeof(exec_id32), leader + TP_OFF_TASK_SELF_EXEC_ID);
    key.sample.exec_id = exec_id32;
#endif

    /* Kernel stack only when the sample interrupted kernel code. */
    key.sample.kstack_id = TP_NO_KSTACK;
    if (PT_REGS_IP(&ctx->regs) >> 63) {
        int id = buffer ? kstacks1.get_stackid(ctx, 0) : kstacks0.get_stackid(ctx, 0);
        if (id >= 0 || id == -EFAULT) {
            key.sample.kstack_id = id < 0 ? TP_NO_KSTACK : id;
        } else {
            /* The kernel part is lost; the key keeps the reason (-errno). */
            key.sample.kstack_id = id;
            bump(id == -EEXIST ? TP_CNT_KSTACK_COLLISION : TP_CNT_KSTACK_ERROR);
        }
    }

    __u32 task_flags = 0;
    bpf_probe_read_kernel(&task_flags, sizeof(task_flags), task + TP_OFF_TASK_FLAGS);
    __u64 ip = 0, sp = 0, fp = 0;
    if (task_flags & TP_PF_KTHREAD) {
        bump(TP_CNT_KERNEL_THREAD);
    } else if (user_regs(ctx, &ip, &sp, &fp) == 0) {
        struct tp_user_stack *st = scratch.lookup(&zero);
        struct tp_stack_page *copy = stack_copy.lookup(&zero);
        if (!st || !copy)
            return 0;
        __u64 hash = 0, copied = 0;
        walk_user(st, copy, &copied, ip, sp, fp, &hash);
        __u64 check = st->check;
        int chained = walk_chain(st, copy, &copied, tgid, task, &hash, &check);
        if (!chained && scan_procs.lookup(&tgid)) {
            struct tp_pending *p = pending.lookup(&zero);
            struct tp_scan_scratch *sc = scan_scratch.lookup(&zero);
            if (p && sc) {
                p->key = key;
                p->hash = hash;
                p->check = check;
                p->sp = sp;
                p->run = 0;
                sc->n = 0;
                sc->pad = 0;
                sc->last_page = 0;
                sc->stale = 0;
                scan_programs.call(ctx, 0);
            }
            /* No scan program (or no slot): the sample keeps its fp frames. */
        }
        if (!finish_sample(ctx, &key, st, hash, check, TP_CNT_CHAIN_SAMPLES))
            return 0;
    }
    return count_sample(&key);
}
