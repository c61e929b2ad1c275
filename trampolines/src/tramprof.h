/*
 * tramprof-trampolines: per-code-object machine-code stubs that keep a
 * per-thread chain of stub frames. See ../ABI.md for the stable layout of
 * tramprof_descriptor and of the stub frames.
 *
 * The region between CDEF BEGIN and CDEF END is also fed verbatim to
 * cffi's cdef() by build.py, so it is the one definition shared by C and
 * Python; it must stay free of preprocessor directives and attributes.
 */
#ifndef TRAMPROF_H
#define TRAMPROF_H

#include <stddef.h>
#include <stdint.h>

/* CDEF BEGIN */
struct tramprof_arena_range {
    uint64_t start;                 /* first byte of the arena */
    uint64_t end;                   /* one past the last byte */
};

struct tramprof_descriptor {
    char magic[8];                  /*   0 "TRAMPROF", no NUL */
    uint32_t abi_version;           /*   8 TRAMPROF_ABI_VERSION */
    uint32_t arch;                  /*  12 ELF e_machine: 62 x86-64, 183 aarch64 */
    uint32_t stub_size;             /*  16 bytes of code per stub (perf map size) */
    uint32_t stub_stride;           /*  20 distance between consecutive stubs */
    uint32_t stub_return_offset;    /*  24 return address of the evaluator call, from stub start */
    uint32_t state;                 /*  28 0 never activated, 1 active, 2 deactivated */
    int64_t tls_offset;             /*  32 chain head address minus thread pointer */
    uint32_t record_prev_offset;    /*  40 record.prev, from the record address */
    uint32_t record_self_offset;    /*  44 record.self, from the record address */
    int32_t record_fp_offset;       /*  48 stub frame pointer value minus record address */
    uint32_t pid;                   /*  52 process that last (re)initialised the runtime */
    uint64_t arenas;                /*  56 address of struct tramprof_arena_range[arena_capacity] */
    uint32_t arena_count;           /*  64 valid entries; grows only, published after the entry */
    uint32_t arena_capacity;        /*  68 */
    uint64_t stub_count;            /*  72 stubs handed out so far */
    uint64_t generation;            /*  80 bumped when state, pid or arena_count change */
    char runtime_version[32];       /*  88 "tramprof-trampolines X.Y.Z", NUL-terminated */
    char python_version[16];        /* 120 e.g. "3.11.2", NUL-terminated */
    /* ABI 2: duty cycle (written by the profiler) and its accounting. */
    uint32_t duty_ppm;              /* 136 share of time the hook is on, millionths; 0 or 1000000: always */
    uint32_t window_us;             /* 140 length of one on/off window (0: 1 s) */
    uint32_t paused;                /* 144 1 while the duty cycle has the hook off */
    uint32_t reserved;              /* 148 */
    uint64_t hook_calls;            /* 152 Python calls made through stubs */
    uint64_t off_ns;                /* 160 CLOCK_MONOTONIC time paused, closed pauses */
    uint64_t paused_since_ns;       /* 168 CLOCK_MONOTONIC start of the current pause, 0 if on */
    uint64_t call_cost_ps;          /* 176 measured extra cost of one call through the hook */
};                                  /* 184 bytes */

extern struct tramprof_descriptor tramprof_descriptor;

int tramprof_activate(int mode, int jitdump, char *err, size_t errlen);
int tramprof_jitdump_path(char *out, size_t outlen);
int tramprof_deactivate(char *err, size_t errlen);
int tramprof_is_active(void);
int tramprof_mode(void);
int tramprof_after_fork_child(char *err, size_t errlen);
int tramprof_debug_chain(uint64_t *out, int max);
uint64_t tramprof_calibration_rounds(void);
uint64_t tramprof_calibration_dropped(void);
uint64_t tramprof_stub_for_code(void *code);
int tramprof_perf_map_path(char *out, size_t outlen);
/* CDEF END */

#define TRAMPROF_ABI_VERSION 2
#define TRAMPROF_DUTY_ALWAYS 1000000
#define TRAMPROF_MODE_STUBS 1
#define TRAMPROF_MODE_HOOK_ONLY 2

#endif
