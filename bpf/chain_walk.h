/* Trampoline chain walk: processes running our trampoline runtime
 * (trampolines/ABI.md).
 *
 * Walks: the thread's chain of trampoline records {prev, self}, from its head
 * (thread-local, at a fixed offset from the fs base) outward. Each record lies
 * in a running stub's frame; each becomes one trampoline frame in
 * tp_user_stack.tramp (ip = the stub's start, sp = the record's address),
 * innermost first, mixed into both stack hashes. Works without frame pointers.
 *
 * Maps: the process's chain_procs entry (TLS offset and stub stride), looked
 * up by the caller and passed in, and stub_pages (arena page -> arena start,
 * to validate `self`) through the accessor stub_arena_of() defined in
 * profile.bpf.c (bcc rewrites map calls only in the main file); reads the
 * stack through stack_pair().
 *
 * Limits: at most TP_MAX_TRAMP records (more: TP_CHAIN_TRUNCATED). Stops at
 * the first record that fails validation - unreadable, misaligned, not above
 * the previous one, or `self` not a stub start in one of the process's arenas
 * (TP_CHAIN_INVALID); the records before it are kept. A `self` on a page of
 * no known arena also marks the process in stale_chains (note_stale_chain(),
 * profile.bpf.c): its runtime may have made an arena the daemon has not
 * installed yet.
 *
 * Part of profile.bpf.c (one translation unit for bcc): included after the
 * maps and shared helpers, not on its own.
 */
#ifndef TRAMPROF_CHAIN_WALK_H
#define TRAMPROF_CHAIN_WALK_H

/* Trampoline chain walk (processes running our runtime, trampolines/ABI.md):
 * the thread's chain head sits at a fixed offset from its thread pointer
 * (fs base); each record {prev, self} lies in a stub's frame. Every record is
 * validated: above the previous one on the stack, and `self` an exact stub
 * start inside one of the process's arenas. No frame pointers needed. */
static __always_inline int walk_chain(struct tp_user_stack *st, struct tp_stack_page *copy,
                                      __u64 *copied, __u32 tgid, struct tp_chain_proc *proc,
                                      __u64 *hash, __u64 *check)
{
    st->nr_tramp = 0;
    if (!proc || proc->stub_stride == 0)
        return 0;
    if (proc->paused_addr) {
        /* The duty cycle has the hook off: records may remain, but frames
         * entered since have none; name no Python frame at all. The flag
         * goes into the hash so paused and unpaused stacks stay apart. */
        __u32 paused = 0;
        if (bpf_probe_read_user(&paused, sizeof(paused), (void *)proc->paused_addr) == 0 &&
            paused) {
            st->flags |= TP_PYTHON_PAUSED;
            *hash = mix_a(*hash, TP_PYTHON_PAUSED);
            *check = mix_b(*check, TP_PYTHON_PAUSED);
            return 1;
        }
    }
    struct task_struct *task = bpf_get_current_task_btf();
    __u64 fsbase = TP_FIELD(task, TP_OFF_TASK_FSBASE, __u64);
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
    for (int i = 0; i < TP_MAX_TRAMP; i++) {
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
            __u64 *arena = stub_arena_of(&page);
            if (!arena) {
                note_stale_chain(tgid);
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
        st->tramp[i & (TP_MAX_TRAMP - 1)].ip = stub;
        st->tramp[i & (TP_MAX_TRAMP - 1)].sp = head;
        h = mix_a(h, stub);
        c = mix_b(c, stub);
        n = i + 1;
        below = head;
        head = record[0];
    }
    if (n >= TP_MAX_TRAMP && head != 0)
        st->flags |= TP_CHAIN_TRUNCATED;
    st->nr_tramp = n;
    *hash = h;
    *check = c;
    return 1;
}

#endif
