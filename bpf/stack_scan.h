/* Stack scan for stub return addresses: processes whose stubs we do not
 * control ("scan" mode: CPython 3.12+ -X perf).
 *
 * Walks: the user stack word by word from the sampled sp upward, in chunks of
 * TP_SCAN_CHUNK_WORDS words, and takes every word that is a stub's return
 * address (see struct tp_scan_proc) as a trampoline frame in
 * tp_user_stack.tramp (ip = the stub's start, sp = the word's address),
 * innermost first, mixed into both stack hashes. Words whose stub's caller
 * has left no return address next to them are stale: not kept, counted.
 *
 * Maps: stub_pages (is the word's page an arena page of this process?),
 * through stub_arena_of() defined in profile.bpf.c (bcc rewrites map calls
 * only in the main file). Its state lives in scan_scratch and the stack page
 * copy (stack_copy), both passed in; the program that drives it, scan_step in
 * profile.bpf.c, tail-calls itself through scan_programs, one run per
 * TP_SCAN_CHUNKS_PER_RUN chunks.
 *
 * Limits: the window is TP_SCAN_BYTES above sp (more readable stack:
 * TP_SCAN_TRUNCATED); it ends early at the first unreadable page. At most
 * TP_SCAN_HITS_PER_CHUNK candidates per chunk and TP_MAX_TRAMP frames in all;
 * past either, frames are lost (TP_SCAN_OVERFLOW).
 *
 * Part of profile.bpf.c (one translation unit for bcc): included after the
 * maps and shared helpers, not on its own.
 */
#ifndef TRAMPROF_STACK_SCAN_H
#define TRAMPROF_STACK_SCAN_H

/* One candidate word of the stack scan: keep it when its page is an arena
 * page of this process. sc->pad set: TP_MAX_TRAMP frames taken. */
static __always_inline void scan_hit(struct tp_user_stack *st, struct tp_scan_scratch *sc,
                                  struct tp_stub_page *page, __u64 w, __u64 roff,
                                  __u64 where, int live, __u64 *h, __u64 *c)
{
    __u64 pg = w & ~0xFFFULL;
    if (pg != sc->last_page) {
        page->page = pg;
        if (!stub_arena_of(page))
            return;
        sc->last_page = pg;
    }
    __u32 n = sc->n;
    if (n >= TP_MAX_TRAMP) { /* the rest of the chunk is skipped too */
        st->flags |= TP_SCAN_OVERFLOW;
        sc->pad = 1;
        return;
    }
    /* A stale word (live == 0) is written past the end and not counted:
     * without a branch, which the verifier pays for on every path. */
    __u64 stub = w - roff;
    __u64 keep = -(__u64)live;
    st->tramp[n & (TP_MAX_TRAMP - 1)].ip = stub;
    st->tramp[n & (TP_MAX_TRAMP - 1)].sp = where;
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
             * in a live C frame has usually lost it. A caller word past the
             * copied page is read on its own (an unreadable one: kept). */
            __u32 cj = at + j + cwords;
            __u64 cword = copy->words[cj & 511];
            int unread = 0;
            if (cj >> 9)
                unread = bpf_probe_read_user(&cword, sizeof(cword),
                                             (void *)(addr + (j + cwords) * 8)) != 0;
            __u64 cx = cword - cmin;
            int live = ((((cx - cspan) & ~cx) >> 63) | unread | !cwords) & 1;
            scan_hit(st, sc, &page, cw[j], roff, addr + j * 8, live, &h, &c);
            bits &= bits - 1;
        }
        if (bits)
            st->flags |= TP_SCAN_OVERFLOW; /* more candidates than pass 2 takes */
        if (sc->pad) {
            over = 1;
            break;
        }
    }
    st->nr_tramp = sc->n;
    *hash = h;
    *check = c;
    return over;
}

#endif
