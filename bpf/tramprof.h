/* Records shared by the BPF programs and the daemon.
 *
 * Every struct here has a ctypes mirror in daemon/tramprof/sampler/layout.py and
 * a test that compiles this header and compares sizes and offsets, so the two
 * sides cannot drift apart silently. Only fixed-width types, explicit padding.
 */
#ifndef TRAMPROF_H
#define TRAMPROF_H

/* Deepest user stack recorded; deeper stacks are cut and flagged. */
#define TP_MAX_FRAMES 127
#define TP_COMM_LEN 16

/* tp_sample_key.kstack_id when the sample has no kernel part. Any other
 * negative value is a lost kernel stack: -errno of bpf_get_stackid(). */
#define TP_NO_KSTACK (-1)

/* Most trampoline frames recorded per stack (one per Python frame), found by
 * the chain walk or by the stack scan. */
#define TP_MAX_TRAMP 256

/* Bits of tp_user_stack.flags. */
#define TP_USTACK_TRUNCATED 0x1   /* depth limit reached with frames left */
#define TP_USTACK_FAULT 0x2       /* a frame record could not be read */
#define TP_USTACK_NO_USER 0x4     /* kernel thread or no user registers */
#define TP_CHAIN_TRUNCATED 0x8    /* chain walk: more records than TP_MAX_TRAMP */
#define TP_CHAIN_INVALID 0x10     /* chain walk: a record failed validation */
#define TP_SCAN_TRUNCATED 0x20    /* stack scan window ended on readable stack */
#define TP_SCAN_OVERFLOW 0x40     /* scan found more stub return addresses than it keeps */
#define TP_TABLE_STOP 0x80        /* table walk: code without an unwind rule it can follow */
#define TP_USTACK_ROOT 0x100      /* table walk: the outermost frame was reached */
#define TP_PYTHON_PAUSED 0x200    /* chain walk: the runtime's duty cycle has its hook off */

/* Indexes of the per-CPU counters array (cumulative, never reset). */
enum tp_counter {
    TP_CNT_SAMPLES = 0,          /* program invocations */
    TP_CNT_RECORDED,             /* samples counted in a buffer */
    TP_CNT_IDLE,                 /* CPU idle (pid 0): not a process */
    TP_CNT_FILTERED,             /* not a target pid */
    TP_CNT_LOST_COUNTS_FULL,     /* count map full: sample lost */
    TP_CNT_LOST_USTACKS_FULL,    /* user stack map full: sample lost */
    TP_CNT_LOST_USTACK_COLLISION,/* two user stacks, one hash: sample lost */
    TP_CNT_KSTACK_COLLISION,     /* kernel stack map -EEXIST: kernel part lost */
    TP_CNT_KSTACK_ERROR,         /* kernel stack other error: kernel part lost */
    TP_CNT_USTACK_FAULT,         /* user walk stopped on an unreadable frame */
    TP_CNT_USTACK_TRUNCATED,     /* user walk hit TP_MAX_FRAMES */
    TP_CNT_KERNEL_THREAD,        /* sample in a kernel thread */
    TP_CNT_CHAIN_SAMPLES,        /* samples unwound through a trampoline chain */
    TP_CNT_CHAIN_TRUNCATED,      /* chain longer than TP_MAX_TRAMP */
    TP_CNT_CHAIN_INVALID,        /* chain walk stopped at an invalid record */
    TP_CNT_SCAN_SAMPLES,         /* samples with trampoline frames found by stack scan */
    TP_CNT_SCAN_TRUNCATED,       /* stack scan window ended before the stack did */
    TP_CNT_SCAN_STALE,           /* stub return addresses found by scan without a live caller */
    TP_CNT_SCAN_OVERFLOW,        /* scan found more stub return addresses than it keeps */
    TP_CNT_TABLE_SAMPLES,        /* samples unwound with at least one unwind-table row */
    TP_CNT_TABLE_STOP_NONE,      /* table walk stopped: no unwind information for the pc */
    TP_CNT_TABLE_STOP_UNSUPPORTED, /* table walk stopped: a rule the walker cannot follow */
    TP_CNT_MAX
};

struct tp_config {
    __u32 active_buffer;   /* 0 or 1: which buffer the programs write */
    __u32 filter_pids;     /* 1: record only tgids present in target_pids */
    /* 0 in every config the daemon writes, and it writes the config after
     * every change to target_pids and every entry it adds to a per-process
     * walker map (chain_procs, scan_procs, unwind_procs); a program that
     * finds 0 sets a new stamp, larger than all before. The programs' per-CPU
     * memos of lookups in those maps hold only under the stamp they were made
     * under (tp_memo in profile.bpf.c). */
    __u64 stamp;
};

struct tp_frame {
    __u64 ip;   /* leaf: sampled pc; others: return address */
    __u64 sp;   /* stack address of the frame (leaf: sp, others: frame pointer) */
};

struct tp_user_stack {
    __u32 nr;
    __u32 flags;
    __u64 check;   /* second, independent hash: detects key collisions */
    /* Entries of tramp[]; beside nr and check, which a stored stack is
     * compared by, so that takes one cache line. */
    __u32 nr_tramp;
    __u32 pad;
    struct tp_frame frames[TP_MAX_FRAMES];
    /* Trampoline frames, from the chain walk or the stack scan, innermost
     * first: ip = stub start, sp = the stack address of the chain record or
     * of the scanned return address (orders them among the native frames). */
    struct tp_frame tramp[TP_MAX_TRAMP];
};

/* A user stack without trampoline frames (native code, JIT code walked by
 * frame pointers, Python without the runtime), stored in native_ustacks:
 * tp_user_stack's bytes up to tramp[], so one scratch copy stores either.
 * 2 KiB instead of 6: the kernel allocates, copies, reads out and frees a
 * stored stack by its size (freeing 1,100 took 5.6 ms at 6 KiB, 2.3 ms at
 * 2 KiB). */
struct tp_native_stack {
    __u32 nr;
    __u32 flags;
    __u64 check;
    __u32 nr_tramp;   /* always 0 */
    __u32 pad;
    struct tp_frame frames[TP_MAX_FRAMES];
};

/* The bit of a stored stack's hash that tells the two maps apart: set for a
 * stack with trampoline frames (ustacks), clear for one without
 * (native_ustacks). A count key names its stack by hash alone, so the same
 * hash must never stand for a stack in each. */
#define TP_USTACK_HASH_TRAMP 2

/* A process running the trampoline runtime (see trampolines/ABI.md). */
struct tp_chain_proc {
    __s64 tls_offset;     /* chain head's address minus the thread pointer */
    __u32 stub_stride;    /* distance between stubs in an arena */
    __u32 record_self;    /* offset of record.self in a record */
    __u64 paused_addr;    /* the descriptor's `paused` word (ABI 2), 0 if none */
};

/* A process whose stubs are found by scanning its stack ("scan" mode: CPython
 * 3.12+ -X perf). A word w on the stack is a stub's return address when it
 * lies in an arena page (stub_pages) and w & stride_mask == return_offset:
 * arenas are page-aligned and the stride a power of two dividing the page size. */
struct tp_scan_proc {
    __u64 arena_min;      /* lowest arena start */
    __u64 arena_span;     /* highest arena end minus arena_min */
    __u32 stride_mask;    /* stride - 1 */
    __u32 return_offset;  /* return address minus stub start */
    /* A running stub's caller (the interpreter) left its own return address
     * caller_offset bytes above the stub's; a stale stub return address in a
     * live C frame rarely has one there. 0: no check. */
    __u64 caller_min;     /* the interpreter's executable text */
    __u64 caller_span;
    __u32 caller_offset;
    /* Where return addresses of the stubs can be: the stub's caller calls it
     * with the stack 16-byte aligned (the x86-64 ABI), so its return address
     * lies at 16n + 8 - caller_offset % 16. 0: any word; 1: at 16n; 2: at 16n + 8. */
    __u32 word_phase;
};

/* One page of a trampoline arena of one process -> the arena's start. */
struct tp_stub_page {
    __u32 tgid;
    __u32 pad;
    __u64 page;
};

/* Unwind tables ("eh_frame" mode): rows compiled from an object's CFI
 * (daemon/tramprof/unwind/cfi.py). A row covers the ELF addresses from its pc
 * to the next row's pc. cfa: the rule kind in the low TP_CFA_KIND_BITS bits,
 * above them the CFA offset / 8 (TP_CFA_PLT: the threshold of rip & 15).
 * rbp: where the caller's rbp was saved, / 8 from the CFA (0: not saved).
 * The return address is always at CFA - 8 (other rules are UNSUPPORTED). */
#define TP_CFA_KIND_BITS 3
#define TP_CFA_KIND_MASK 7
#define TP_CFA_RSP 0          /* cfa = rsp + offset */
#define TP_CFA_RBP 1          /* cfa = rbp + offset */
#define TP_CFA_PLT 2          /* cfa = rsp + 8 + ((rip & 15) >= threshold ? 8 : 0) */
#define TP_CFA_SIGNAL 3       /* signal trampoline: registers in the ucontext at rsp */
#define TP_CFA_END 4          /* the return address is undefined: outermost frame */
#define TP_CFA_NONE 5         /* no CFI covers this address */
#define TP_CFA_UNSUPPORTED 6  /* CFI the walker cannot follow */

/* Rows live in chunks (inner array maps of TP_UNWIND_CHUNK_ROWS rows); row r
 * of the global row space is row r % CHUNK of chunk slot r / CHUNK. */
#define TP_UNWIND_CHUNK_ROWS 4096
#define TP_MAX_UNWIND_MAPPINGS 64

struct tp_unwind_row {
    __u32 pc;
    __u16 cfa;
    __s16 rbp;
};

/* An executable mapping of an object with a loaded table: pc - bias is the
 * ELF address looked up in rows [first_row, first_row + nr_rows). */
struct tp_unwind_mapping {
    __u64 start;
    __u64 end;
    __u64 bias;
    __u32 first_row;
    __u32 nr_rows;
};

/* A process unwound with tables: its mappings sorted by start. */
struct tp_unwind_proc {
    __u32 nr;
    __u32 pad;
    struct tp_unwind_mapping maps[TP_MAX_UNWIND_MAPPINGS];
};

struct tp_sample_key {
    __u32 tgid;
    __s32 kstack_id;        /* >= 0: id in the buffer's kstacks map */
    __u64 start_boottime;   /* group leader's start, ns since boot */
    __u64 exec_id;          /* group leader's self_exec_id: changes on exec */
    __u64 ustack_hash;      /* 0: no user stack */
    char comm[TP_COMM_LEN]; /* thread name */
};

/* Sent once per process image the first time it is sampled, so the daemon
 * reads its maps and binaries while it still runs (short-lived processes
 * would be gone by the next drain). */
struct tp_process_seen {
    __u32 tgid;
    __u32 pad;
    __u64 start_boottime;
    __u64 exec_id;
};

#endif
