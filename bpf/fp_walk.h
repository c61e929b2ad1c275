/* Frame-pointer walk of the sampled thread's user stack.
 *
 * Walks: the linked frame records {caller's fp, return address} from the
 * sampled fp upward, into tp_user_stack.frames (ip = return address, sp =
 * the record's stack address; frame 0 is the sampled pc and sp), and starts
 * the two stack hashes over the return addresses.
 *
 * Maps: none of its own; reads the stack through the per-CPU copy
 * (stack_copy, passed in) with stack_pair().
 *
 * Limits: at most TP_MAX_FRAMES frames (more: TP_USTACK_TRUNCATED); stops at
 * fp 0 or a zero return address, and at a record that is misaligned, not
 * above the previous one, or unreadable (TP_USTACK_FAULT). Code built without
 * frame pointers yields garbage or a short stack: that is what the trampoline
 * chain walk and the stack scan make up for.
 *
 * Part of profile.bpf.c (one translation unit for bcc): included after the
 * maps and shared helpers, not on its own.
 */
#ifndef TRAMPROF_FP_WALK_H
#define TRAMPROF_FP_WALK_H

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

#endif
