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
 *
 * The user-stack walkers have a header each, included below after the maps
 * and shared helpers: fp_walk.h (frame pointers), chain_walk.h (our runtime's
 * trampoline chain), stack_scan.h (stub return addresses on the stack, run by
 * scan_step). bcc compiles this file as one unit but rewrites map calls only
 * in this file, so the headers reach maps through accessors defined here.
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
/* Slots for unwind-table chunks (TP_UNWIND_CHUNK_ROWS rows each); an empty
 * slot costs one pointer, so there are more slots than the memory budget
 * fills, and freed ranges need no compaction. */
#ifndef TP_MAX_UNWIND_CHUNKS
#define TP_MAX_UNWIND_CHUNKS 8192
#endif
#ifndef TP_MAX_UNWIND_PROCS
#define TP_MAX_UNWIND_PROCS 4096
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
    __u32 pad;      /* 1: TP_MAX_TRAMP frames taken, stop */
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

/* The walk's registers between frames and program runs (per CPU; the table walk in table_walk.h). */
struct tp_table_regs {
    __u64 ip;
    __u64 sp;
    __u64 bp;
    __u32 exact;    /* ip is an exact pc (leaf, or resumed after a signal), not a return address */
    __u32 tabled;   /* at least one row was used */
};

/* A sample handed from on_sample to the table walk's runs. */
struct tp_table_pending {
    struct tp_count_key key;
    __u64 hash;
    __u64 check;
    __u64 sp;       /* the sampled sp (the stack scan starts there) */
    __u32 n;        /* frames recorded */
    __u32 stop;     /* why the walk stopped (TP_STEP_*), 0: it did not */
    __u64 copied;   /* the stack chunk in stack_copy: it carries over between runs */
};

/* Per-CPU copy of a piece of the sampled thread's stack (at most a page):
 * frame and chain records lie tens to hundreds of bytes apart, so one user
 * read serves several. */
struct tp_stack_page {
    __u64 words[512];
};

struct tp_ustack_key {
    __u64 hash;
    __u32 buffer;
    __u32 pad;
};

/* Per-CPU memo of what target_pids and the per-process walker maps say about
 * the processes last sampled on this CPU, which mostly runs the same few from
 * one tick to the next: one cache line read instead of up to four hash
 * lookups, each a likely cache and TLB miss. A slot holds only under the
 * config stamp it was made under (tp_config.stamp), so none outlives a change
 * to those maps. For the walker maps it keeps only that there is no entry: an
 * entry is looked up for what it holds. */
#define TP_MEMO_SLOTS 8
#define TP_MEMO_TARGET 0x1      /* in target_pids */
#define TP_MEMO_NOT_TARGET 0x2  /* not in target_pids */
#define TP_MEMO_NO_TABLES 0x4   /* no unwind_procs entry */
#define TP_MEMO_NO_CHAIN 0x8    /* no chain_procs entry */
#define TP_MEMO_NO_SCAN 0x10    /* no scan_procs entry */

struct tp_memo_slot {
    __u64 stamp;    /* 0: empty */
    __u32 tgid;
    __u32 known;    /* TP_MEMO_* */
};

struct tp_memo {
    struct tp_memo_slot slots[TP_MEMO_SLOTS];
};

BPF_ARRAY(config, struct tp_config, 1);
BPF_HASH(target_pids, __u32, __u8, TP_MAX_TARGETS);
BPF_PERCPU_ARRAY(counters, __u64, TP_CNT_MAX);
BPF_PERCPU_ARRAY(memos, struct tp_memo, 1);
/* The last config stamp handed out: stamps only grow. */
BPF_ARRAY(last_stamp, __u64, 1);
BPF_PERCPU_ARRAY(scratch, struct tp_user_stack, 1);
BPF_HASH(counts, struct tp_count_key, __u64, TP_MAX_KEYS);
BPF_F_TABLE("hash", struct tp_ustack_key, struct tp_user_stack, ustacks, TP_MAX_USTACKS,
            BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", struct tp_ustack_key, struct tp_native_stack, native_ustacks,
            TP_MAX_USTACKS, BPF_F_NO_PREALLOC);
BPF_HASH(chain_procs, __u32, struct tp_chain_proc, TP_MAX_CHAIN_PROCS);
BPF_HASH(scan_procs, __u32, struct tp_scan_proc, TP_MAX_CHAIN_PROCS);
BPF_PERCPU_ARRAY(scan_scratch, struct tp_scan_scratch, 1);
BPF_PERCPU_ARRAY(stack_copy, struct tp_stack_page, 1);
BPF_PERCPU_ARRAY(pending, struct tp_pending, 1);
BPF_PROG_ARRAY(scan_programs, 1);
BPF_PERCPU_ARRAY(table_pending, struct tp_table_pending, 1);
BPF_PERCPU_ARRAY(table_regs, struct tp_table_regs, 1);
BPF_PROG_ARRAY(table_programs, 1);
/* The template of every row chunk; chunks are created by the daemon. */
BPF_ARRAY(unwind_chunk, struct tp_unwind_row, TP_UNWIND_CHUNK_ROWS);
BPF_ARRAY_OF_MAPS(unwind_chunks, "unwind_chunk", TP_MAX_UNWIND_CHUNKS);
BPF_F_TABLE("hash", __u32, struct tp_unwind_proc, unwind_procs, TP_MAX_UNWIND_PROCS,
            BPF_F_NO_PREALLOC);
BPF_HASH(stub_pages, struct tp_stub_page, __u64, TP_MAX_STUB_PAGES);
/* Processes whose chain walk met a stub on a page none of their installed
 * arenas covers (the runtime made an arena since): the daemon reads their
 * descriptors at its next look instead of every runtime's, every second.
 * The value is unused; the daemon deletes what it has read. */
BPF_HASH(stale_chains, __u32, __u8, TP_MAX_CHAIN_PROCS);
BPF_TABLE("lru_hash", struct tp_process_seen, __u8, seen_processes, TP_MAX_SEEN);
BPF_PERF_OUTPUT(new_processes);
BPF_STACK_TRACE(kstacks0, TP_MAX_KSTACKS);
BPF_STACK_TRACE(kstacks1, TP_MAX_KSTACKS);

/* The config's stamp (tp_config.stamp). When the daemon has zeroed it, the
 * first program to run sets a new one, larger than all before it. The
 * compare-and-swap is a full barrier: lookups after it see every map change
 * that preceded the daemon's config write. 0: no stamp, memos unusable. */
static __always_inline __u64 config_stamp(struct tp_config *cfg)
{
    __u64 stamp = *(volatile __u64 *)&cfg->stamp;
    if (stamp)
        return stamp;
    __u32 zero = 0;
    __u64 *last = last_stamp.lookup(&zero);
    if (!last)
        return 0;
    __u64 fresh = __sync_fetch_and_add(last, 1) + 1;
    __u64 found = __sync_val_compare_and_swap(&cfg->stamp, 0, fresh);
    return found ? found : fresh;
}

/* This CPU's memo slot for `tgid`, emptied if it held another process or an
 * old stamp; 0 without a stamp. */
static __always_inline struct tp_memo_slot *memo_slot(__u32 tgid, __u64 stamp)
{
    __u32 zero = 0;
    struct tp_memo *memo = memos.lookup(&zero);
    if (!memo || !stamp)
        return 0;
    struct tp_memo_slot *slot = &memo->slots[tgid % TP_MEMO_SLOTS];
    if (slot->tgid != tgid || slot->stamp != stamp) {
        slot->tgid = tgid;
        slot->stamp = stamp;
        slot->known = 0;
    }
    return slot;
}

static __always_inline void bump(__u32 counter)
{
    __u64 *value = counters.lookup(&counter);
    if (value)
        *value += 1; /* per-CPU slot: no atomics needed */
}

/* A kernel struct field, `off` bytes into the struct at `ptr`. `ptr` must come
 * from a BTF-typed source (bpf_get_current_task_btf(), bpf_task_pt_regs(), a
 * pointer field loaded this way): the verifier checks the offset against the
 * kernel's BTF and makes the load fault-safe (a fault reads 0), so it is a
 * plain load instead of a bpf_probe_read_kernel() call. */
#define TP_FIELD(ptr, off, type) (*(type *)((char *)(ptr) + (off)))

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
    __u64 usp = PT_REGS_SP(&ctx->regs), ubp = PT_REGS_FP(&ctx->regs);
    /* Loaded here, before the branch: else the compiler may merge these
     * context loads with the loads below into one through a pointer that
     * is either, which the verifier refuses for the context. */
    asm volatile("" : "+r"(usp), "+r"(ubp));
    if (!(pc >> 63)) {
        *ip = pc;
        *sp = usp;
        *bp = ubp;
        return 0;
    }
    struct task_struct *task = bpf_get_current_task_btf();
    struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);
    if (!regs)
        return -1;
    *ip = TP_FIELD(regs, TP_OFF_PT_REGS_IP, __u64);
    *sp = TP_FIELD(regs, TP_OFF_PT_REGS_SP, __u64);
    *bp = TP_FIELD(regs, TP_OFF_PT_REGS_BP, __u64);
    return *ip ? 0 : -1;
}

/* Bytes of stack copied per user read, an aligned chunk of a page. A user
 * read costs a fixed part plus the cache lines it copies (from the stack
 * and into the per-CPU copy): a page costs several times a small chunk, and
 * a shallow stack's records fit in one or two chunks. */
#ifndef TP_STACK_CHUNK_BYTES
#define TP_STACK_CHUNK_BYTES 1024
#endif
#define TP_STACK_CHUNK_WORDS (TP_STACK_CHUNK_BYTES / 8)

/* The two words at `at` (8-aligned) of the sampled thread's stack: a frame
 * record {caller fp, return address} or a chain record {prev, self}. Read
 * through the per-CPU copy of the chunk around `at`: consecutive records lie
 * tens to hundreds of bytes apart, so one user read serves several. A pair
 * that straddles chunks, or a chunk that cannot be read whole, is read
 * directly. `*copied` is the chunk in the copy (0: none). */
static __always_inline int stack_pair(struct tp_stack_page *copy, __u64 *copied, __u64 at,
                                      __u64 record[2])
{
    __u64 chunk = at & ~(__u64)(TP_STACK_CHUNK_BYTES - 1);
    __u32 idx = (at & (TP_STACK_CHUNK_BYTES - 1)) >> 3;
    if (idx <= TP_STACK_CHUNK_WORDS - 2) {
        if (chunk != *copied &&
            bpf_probe_read_user(copy->words, TP_STACK_CHUNK_BYTES, (void *)chunk) == 0)
            *copied = chunk;
        if (chunk == *copied) {
            record[0] = copy->words[idx];
            record[1] = copy->words[idx + 1];
            return 0;
        }
    }
    return bpf_probe_read_user(record, 16, (void *)at);
}

/* Map accessors for the walkers in the headers below: bcc rewrites map calls
 * (map.lookup()) only in this file, not in the files it includes. */
static __always_inline __u64 *stub_arena_of(struct tp_stub_page *page)
{
    return stub_pages.lookup(page);
}

/* Tells the daemon that `tgid`'s chain went through an arena it has not
 * installed (stale_chains). */
static __always_inline void note_stale_chain(__u32 tgid)
{
    __u8 yes = 1;
    if (!stale_chains.lookup(&tgid))
        stale_chains.update(&tgid, &yes);
}

/* Row `index` of the global row space, or 0 when its chunk is not loaded. */
static __always_inline struct tp_unwind_row *unwind_row(__u32 index)
{
    __u32 slot = index / TP_UNWIND_CHUNK_ROWS;
    __u32 at = index % TP_UNWIND_CHUNK_ROWS;
    void *chunk = unwind_chunks.lookup(&slot);
    if (!chunk)
        return 0;
    return bpf_map_lookup_elem(chunk, &at);
}

/* The user-stack walkers: one header each. */
#include "fp_walk.h"    /* frame pointers: every sample */
#include "chain_walk.h" /* our runtime's trampoline chain */
#include "stack_scan.h" /* stub return addresses on the stack: scan_step's runs */
#include "table_walk.h" /* unwind tables for code without frame pointers: table_step's runs */

/* Adds one to `key`'s count, or 0 when the key is new to the buffer. */
static __always_inline int count_again(struct tp_count_key *key)
{
    __u64 *count = counts.lookup(key);
    if (!count)
        return 0;
    __sync_fetch_and_add(count, 1);
    bump(TP_CNT_RECORDED);
    return 1;
}

/* Counts a sample under a key new to the buffer. */
static __always_inline int count_new(struct tp_count_key *key)
{
    __u64 one = 1;
    if (counts.update(key, &one) != 0) {
        /* Another CPU may have inserted the key meanwhile; retry once. */
        if (!count_again(key))
            bump(TP_CNT_LOST_COUNTS_FULL);
        return 0;
    }
    bump(TP_CNT_RECORDED);
    return 0;
}

/* A sample without a user stack. */
static __always_inline int count_sample(struct tp_count_key *key)
{
    if (!count_again(key))
        count_new(key);
    return 0;
}

/* Sent once per process image (its first sample with a user stack), so the
 * daemon reads its maps and binaries while it still runs. */
static __always_inline void announce_process(struct bpf_perf_event_data *ctx,
                                             struct tp_count_key *key)
{
    struct tp_process_seen seen = {.tgid = key->sample.tgid,
                                   .start_boottime = key->sample.start_boottime,
                                   .exec_id = key->sample.exec_id};
    if (!seen_processes.lookup(&seen)) {
        __u8 yes = 1;
        seen_processes.update(&seen, &yes);
        new_processes.perf_submit(ctx, &seen, sizeof(seen));
    }
}

/* The end of every sample with a user stack: its flags counted, then its
 * count. A key new to this buffer stores the stack (in ustacks, or in
 * native_ustacks when it has no trampoline frames; deduplicated by hash,
 * checked against a stored stack with that hash), announces the process image
 * if that is new too, and is added. A key already counted in this buffer
 * needs none of that, so the common case is one lookup: the key holds the
 * stack's hash and the process image, and was added only after its stack was
 * stored or found equal to the stored one, which stays until the buffer is
 * drained. (A stack colliding with another process's has another key, and is
 * checked; only two stacks of one process image, thread name and kernel
 * stack with one 64-bit hash would share a key unchecked.) */
static __always_inline int finish_sample(struct bpf_perf_event_data *ctx,
                                         struct tp_count_key *key, struct tp_user_stack *st,
                                         __u64 hash, __u64 check, int mode)
{
    st->check = check;
    hash |= 1; /* never 0: 0 means "no user stack" */
    if (st->nr_tramp) {
        hash |= (__u64)TP_USTACK_HASH_TRAMP;
        bump(mode);
    } else {
        hash &= ~(__u64)TP_USTACK_HASH_TRAMP;
    }
    if (st->flags & TP_SCAN_TRUNCATED)
        bump(TP_CNT_SCAN_TRUNCATED);
    if (st->flags & TP_CHAIN_TRUNCATED)
        bump(TP_CNT_CHAIN_TRUNCATED);
    if (st->flags & TP_CHAIN_INVALID)
        bump(TP_CNT_CHAIN_INVALID);
    if (st->flags & TP_SCAN_OVERFLOW)
        bump(TP_CNT_SCAN_OVERFLOW);
    if (st->flags & TP_USTACK_FAULT)
        bump(TP_CNT_USTACK_FAULT);
    if (st->flags & TP_USTACK_TRUNCATED)
        bump(TP_CNT_USTACK_TRUNCATED);

    key->sample.ustack_hash = hash;
    if (count_again(key))
        return 0;
    struct tp_ustack_key skey = {.hash = hash, .buffer = key->buffer};
    /* Only the header of a stored stack is read here, and a native one has
     * the same header. */
    struct tp_user_stack *stored = st->nr_tramp
        ? ustacks.lookup(&skey) : (struct tp_user_stack *)native_ustacks.lookup(&skey);
    if (stored) {
        if (stored->check != st->check || stored->nr != st->nr ||
            stored->nr_tramp != st->nr_tramp) {
            bump(TP_CNT_LOST_USTACK_COLLISION);
            return 0;
        }
    } else if ((st->nr_tramp ? ustacks.update(&skey, st)
                : native_ustacks.update(&skey, (struct tp_native_stack *)st)) != 0) {
        bump(TP_CNT_LOST_USTACKS_FULL);
        return 0;
    }
    announce_process(ctx, key);
    return count_new(key);
}

/* After the native walk (FP or tables): the trampoline frames (chain walk
 * here, or the scan's runs by tail call), then store and count. `memo`: this
 * CPU's memo slot for the process, 0 for none. */
static __always_inline int after_native(struct bpf_perf_event_data *ctx, struct tp_count_key *key,
                                        struct tp_user_stack *st, struct tp_stack_page *copy,
                                        __u64 *copied, __u64 sp, __u64 hash, __u64 check,
                                        struct tp_memo_slot *memo)
{
    __u32 zero = 0;
    __u32 tgid = key->sample.tgid;
    __u32 known = memo ? memo->known : 0;
    struct tp_chain_proc *chain = 0;
    if (!(known & TP_MEMO_NO_CHAIN)) {
        chain = chain_procs.lookup(&tgid);
        if (!chain)
            known |= TP_MEMO_NO_CHAIN;
    }
    int chained = walk_chain(st, copy, copied, tgid, chain, &hash, &check);
    int scanned = 0;
    if (!chained && !(known & TP_MEMO_NO_SCAN)) {
        scanned = scan_procs.lookup(&tgid) != 0;
        if (!scanned)
            known |= TP_MEMO_NO_SCAN;
    }
    if (memo)
        memo->known = known;
    if (scanned) {
        struct tp_pending *p = pending.lookup(&zero);
        struct tp_scan_scratch *sc = scan_scratch.lookup(&zero);
        if (p && sc) {
            p->key = *key;
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
        /* No scan program (or no slot): the sample keeps its native frames. */
    }
    return finish_sample(ctx, key, st, hash, check, TP_CNT_CHAIN_SAMPLES);
}

/* One run of the table walk, tail-called by on_sample and by itself. */
int table_step_run(struct bpf_perf_event_data *ctx)
{
    __u32 zero = 0;
    struct tp_table_pending *p = table_pending.lookup(&zero);
    struct tp_table_regs *r = table_regs.lookup(&zero);
    struct tp_user_stack *st = scratch.lookup(&zero);
    struct tp_stack_page *copy = stack_copy.lookup(&zero);
    if (!p || !r || !st || !copy)
        return 0;
    __u32 tgid = p->key.sample.tgid;
    struct tp_unwind_proc *proc = unwind_procs.lookup(&tgid);
    int over = 1;
    if (proc)
        over = table_run(st, copy, &p->copied, proc, r, &p->n, &p->hash, &p->check, &p->stop);
    if (!over) {
        table_programs.call(ctx, 0);
        /* Tail call refused (the limit is reached): keep what was found. */
        st->flags |= TP_USTACK_TRUNCATED;
    }
    if (r->tabled)
        bump(TP_CNT_TABLE_SAMPLES);
    if (p->stop == TP_STEP_STOP_NONE)
        bump(TP_CNT_TABLE_STOP_NONE);
    else if (p->stop == TP_STEP_STOP_UNSUPPORTED)
        bump(TP_CNT_TABLE_STOP_UNSUPPORTED);
    struct tp_count_key key = p->key;
    __u64 copied = p->copied;
    return after_native(ctx, &key, st, copy, &copied, p->sp, p->hash, p->check, 0);
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
        /* Tail call refused (the tail-call limit is reached): keep what
         * was found. */
        st->flags |= TP_SCAN_TRUNCATED;
    }
    if (sc->stale) {
        __u32 counter = TP_CNT_SCAN_STALE;
        __u64 *value = counters.lookup(&counter);
        if (value)
            *value += sc->stale;
    }
    return finish_sample(ctx, &p->key, st, p->hash, p->check, TP_CNT_SCAN_SAMPLES);
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
    struct tp_memo_slot *memo = memo_slot(tgid, config_stamp(cfg));
    __u32 known = memo ? memo->known : 0;
    if (cfg->filter_pids) {
        if (!(known & (TP_MEMO_TARGET | TP_MEMO_NOT_TARGET))) {
            known |= target_pids.lookup(&tgid) ? TP_MEMO_TARGET : TP_MEMO_NOT_TARGET;
            if (memo)
                memo->known = known;
        }
        if (known & TP_MEMO_NOT_TARGET) {
            bump(TP_CNT_FILTERED);
            return 0;
        }
    }
    __u32 buffer = cfg->active_buffer & 1;

    struct tp_count_key key = {};
    key.buffer = buffer;
    key.sample.tgid = tgid;
    bpf_get_current_comm(&key.sample.comm, sizeof(key.sample.comm));

    struct task_struct *task = bpf_get_current_task_btf();
    struct task_struct *leader = TP_FIELD(task, TP_OFF_TASK_GROUP_LEADER, struct task_struct *);
    key.sample.start_boottime = TP_FIELD(leader, TP_OFF_TASK_START_BOOTTIME, __u64);
#if TP_SIZE_TASK_SELF_EXEC_ID == 8
    key.sample.exec_id = TP_FIELD(leader, TP_OFF_TASK_SELF_EXEC_ID, __u64);
#else
    key.sample.exec_id = TP_FIELD(leader, TP_OFF_TASK_SELF_EXEC_ID, __u32);
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

    __u32 task_flags = TP_FIELD(task, TP_OFF_TASK_FLAGS, __u32);
    __u64 ip = 0, sp = 0, fp = 0;
    if (task_flags & TP_PF_KTHREAD) {
        bump(TP_CNT_KERNEL_THREAD);
    } else if (user_regs(ctx, &ip, &sp, &fp) == 0) {
        struct tp_user_stack *st = scratch.lookup(&zero);
        struct tp_stack_page *copy = stack_copy.lookup(&zero);
        if (!st || !copy)
            return 0;
        int tabled = 0;
        if (!(known & TP_MEMO_NO_TABLES)) {
            tabled = unwind_procs.lookup(&tgid) != 0;
            if (!tabled && memo)
                memo->known = known | TP_MEMO_NO_TABLES;
        }
        if (tabled) {
            struct tp_table_pending *p = table_pending.lookup(&zero);
            struct tp_table_regs *r = table_regs.lookup(&zero);
            if (p && r) {
                st->frames[0].ip = ip;
                st->frames[0].sp = sp;
                st->flags = 0;
                st->nr = 1;
                st->nr_tramp = 0;
                p->key = key;
                p->hash = mix_a(0, ip);
                p->check = mix_b(0, ip);
                p->sp = sp;
                p->n = 1;
                p->stop = 0;
                p->copied = 0;
                r->ip = ip;
                r->sp = sp;
                r->bp = fp;
                r->exact = 1;
                r->tabled = 0;
                table_programs.call(ctx, 0);
            }
            /* No table program (or no slot): the frame-pointer walk below. */
        }
        __u64 hash = 0, copied = 0;
        walk_user(st, copy, &copied, ip, sp, fp, &hash);
        return after_native(ctx, &key, st, copy, &copied, sp, hash, st->check, memo);
    }
    return count_sample(&key);
}
