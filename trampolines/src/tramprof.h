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
};                                  /* 136 bytes */

extern struct tramprof_descriptor tramprof_descriptor;

int tramprof_activate(int mode, int jitdump, char *err, size_t errlen);
int tramprof_jitdump_path(char *out, size_t outlen);
int tramprof_deactivate(char *err, size_t errlen);
int tramprof_is_active(void);
int tramprof_mode(void);
int tramprof_after_fork_child(char *err, size_t errlen);
int tramprof_debug_chain(uint64_t *out, int max);
uint64_t tramprof_stub_for_code(void *code);
int tramprof_perf_map_path(char *out, size_t outlen);
/* CDEF END */

#define TRAMPROF_ABI_VERSION 1
#define TRAMPROF_MODE_STUBS 1
#define TRAMPROF_MODE_HOOK_ONLY 2

#endif
