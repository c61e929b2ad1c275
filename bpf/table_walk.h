/* Unwind-table walk ("eh_frame" mode): native code without frame pointers.
 *
 * Walks: from the sampled registers (ip, sp, bp) frame by frame. For a pc in
 * a mapping of the process's unwind_procs entry, the object's rows (compiled
 * from .eh_frame by the daemon) give the CFA, where the return address is
 * (CFA - 8) and where the caller's rbp was saved; for any other pc (JIT code,
 * trampoline stubs, objects built with frame pointers) it takes a
 * frame-pointer step. Frames go into tp_user_stack.frames with the same
 * conventions as the FP walk (sp = the return address's slot - 8), so the
 * merge with trampoline frames is unchanged.
 *
 * Maps: unwind_procs (per process, via unwind_proc_of), the row chunks
 * (unwind_chunks, an array of array maps, via unwind_row); reads the stack
 * through the per-CPU stack copy with stack_pair(); which chunk the copy
 * holds is kept in table_pending, so a run reuses what the last one read.
 *
 * Limits: TP_TABLE_FRAMES_PER_RUN frames per program run, tail calls for the
 * rest up to TP_MAX_FRAMES; a mapping search of at most log2(64) + 1 steps, a
 * row search of at most 22 (objects have at most 2^21 rows). Stops at the
 * outermost frame (CFI with an undefined return address: TP_USTACK_ROOT), at
 * code without a rule it can follow (TP_TABLE_STOP, counted by reason), and
 * at a CFA not above the frame's sp or an unreadable slot (TP_USTACK_FAULT).
 *
 * Part of profile.bpf.c (one translation unit for bcc): included after the
 * maps and shared helpers, not on its own.
 */
#ifndef TRAMPROF_TABLE_WALK_H
#define TRAMPROF_TABLE_WALK_H

#ifndef TP_TABLE_FRAMES_PER_RUN
#define TP_TABLE_FRAMES_PER_RUN 8
#endif
#define TP_ROW_SEARCH_STEPS 22
#define TP_MAPPING_SEARCH_STEPS 7

/* Outcomes of one step. */
#define TP_STEP_NEXT 0
#define TP_STEP_DONE 1
#define TP_STEP_STOP_NONE 2
#define TP_STEP_STOP_UNSUPPORTED 3

static __always_inline struct tp_unwind_mapping *find_mapping(struct tp_unwind_proc *proc,
                                                             __u64 pc)
{
    __u32 lo = 0, hi = proc->nr;
    if (hi > TP_MAX_UNWIND_MAPPINGS)
        hi = TP_MAX_UNWIND_MAPPINGS;
#pragma unroll 1
    for (int i = 0; i < TP_MAPPING_SEARCH_STEPS; i++) {
        if (lo >= hi)
            break;
        __u32 mid = (lo + hi) / 2;
        if (mid >= TP_MAX_UNWIND_MAPPINGS)
            return 0;
        if (proc->maps[mid].start <= pc)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0 || lo > TP_MAX_UNWIND_MAPPINGS)
        return 0;
    struct tp_unwind_mapping *m = &proc->maps[lo - 1];
    return pc < m->end ? m : 0;
}

/* The row covering `rel` in rows [first, first + nr): the last one whose pc
 * is <= rel. Returns 0 and fills *out, or -1. */
static __always_inline int find_row(__u32 first, __u32 nr, __u32 rel, struct tp_unwind_row *out)
{
    __u32 lo = 0, hi = nr;
#pragma unroll 1
    for (int i = 0; i < TP_ROW_SEARCH_STEPS; i++) {
        if (lo >= hi)
            break;
        __u32 mid = (lo + hi) / 2;
        struct tp_unwind_row *row = unwind_row(first + mid);
        if (!row)
            return -1;
        if (row->pc <= rel)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return -1;
    struct tp_unwind_row *row = unwind_row(first + lo - 1);
    if (!row)
        return -1;
    *out = *row;
    return 0;
}

/* One frame up from r. On TP_STEP_NEXT, r holds the caller's registers and
 * *slot the stack address the frame is ordered by. */
static __always_inline int table_step(struct tp_unwind_proc *proc, struct tp_stack_page *copy,
                                      __u64 *copied, struct tp_table_regs *r, __u64 *slot,
                                      __u32 *flags)
{
    __u64 record[2];
    __u64 pc = r->exact ? r->ip : r->ip - 1;
    struct tp_unwind_mapping *m = find_mapping(proc, pc);
    if (!m) {
        /* No table here: a frame-pointer step, as the FP walk does. */
        __u64 fp = r->bp;
        if (fp == 0)
            return TP_STEP_DONE;
        if (fp < r->sp || (fp & 7) || stack_pair(copy, copied, fp, record)) {
            *flags |= TP_USTACK_FAULT;
            return TP_STEP_DONE;
        }
        *slot = fp;
        r->ip = record[1];
        r->bp = record[0];
        r->sp = fp + 16;
        r->exact = 0;
        return TP_STEP_NEXT;
    }
    struct tp_unwind_row row;
    if (pc - m->bias > 0xFFFFFFFFULL || find_row(m->first_row, m->nr_rows, pc - m->bias, &row))
        return TP_STEP_STOP_NONE;
    __u32 kind = row.cfa & TP_CFA_KIND_MASK;
    __u64 value = row.cfa >> TP_CFA_KIND_BITS;
    __u64 cfa;
    if (kind == TP_CFA_RSP) {
        cfa = r->sp + value * 8;
    } else if (kind == TP_CFA_RBP) {
        cfa = r->bp + value * 8;
    } else if (kind == TP_CFA_PLT) {
        cfa = r->sp + 8 + ((r->ip & 15) >= value ? 8 : 0);
    } else if (kind == TP_CFA_SIGNAL) {
        /* __restore_rt: the interrupted registers are in the ucontext at sp
         * (uc_mcontext.rbp at 120, .rsp at 160, .rip at 168). */
        __u64 regs[2];
        if (stack_pair(copy, copied, r->sp + 160, regs) ||
            stack_pair(copy, copied, r->sp + 120, record)) {
            *flags |= TP_USTACK_FAULT;
            return TP_STEP_DONE;
        }
        *slot = r->sp;
        r->bp = record[0];
        r->sp = regs[0];
        r->ip = regs[1];
        r->exact = 1;
        r->tabled = 1;
        return TP_STEP_NEXT;
    } else if (kind == TP_CFA_END) {
        *flags |= TP_USTACK_ROOT;
        return TP_STEP_DONE;
    } else if (kind == TP_CFA_NONE) {
        return TP_STEP_STOP_NONE;
    } else {
        return TP_STEP_STOP_UNSUPPORTED;
    }
    if (cfa <= r->sp || (cfa & 7) || stack_pair(copy, copied, cfa - 16, record)) {
        *flags |= TP_USTACK_FAULT;
        return TP_STEP_DONE;
    }
    __u64 ra = record[1];
    if (row.rbp) {
        __u64 saved[2];
        if (stack_pair(copy, copied, cfa + (__s64)row.rbp * 8, saved)) {
            *flags |= TP_USTACK_FAULT;
            return TP_STEP_DONE;
        }
        r->bp = saved[0];
    }
    *slot = cfa - 16;
    r->ip = ra;
    r->sp = cfa;
    r->exact = 0;
    r->tabled = 1;
    return TP_STEP_NEXT;
}

/* One program run: up to TP_TABLE_FRAMES_PER_RUN frames after the `*n`
 * recorded so far. Returns 1 when the walk is over, 0 when frames remain. */
static __always_inline int table_run(struct tp_user_stack *st, struct tp_stack_page *copy,
                                     __u64 *copied, struct tp_unwind_proc *proc,
                                     struct tp_table_regs *r, __u32 *n, __u64 *hash,
                                     __u64 *check, __u32 *stop)
{
    __u32 flags = st->flags;
    __u32 at = *n;
    int over = 0;
#pragma unroll 1
    for (int i = 0; i < TP_TABLE_FRAMES_PER_RUN; i++) {
        if (at >= TP_MAX_FRAMES) {
            flags |= TP_USTACK_TRUNCATED;
            over = 1;
            break;
        }
        __u64 slot = 0;
        int step = table_step(proc, copy, copied, r, &slot, &flags);
        if (step != TP_STEP_NEXT) {
            if (step == TP_STEP_STOP_NONE || step == TP_STEP_STOP_UNSUPPORTED) {
                flags |= TP_TABLE_STOP;
                *stop = step;
            }
            over = 1;
            break;
        }
        if (r->ip == 0) {
            over = 1;
            break;
        }
        __u32 idx = at;
        asm volatile("" : "+r"(idx)); /* keep the bounds check on this register */
        if (idx >= TP_MAX_FRAMES)
            break;
        st->frames[idx].ip = r->ip;
        st->frames[idx].sp = slot;
        *hash = mix_a(*hash, r->ip);
        *check = mix_b(*check, r->ip);
        at = idx + 1;
    }
    *n = at;
    st->flags = flags;
    st->nr = *n;
    return over;
}

#endif
