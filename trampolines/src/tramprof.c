/*
 * tramprof-trampolines runtime: a PEP 523 eval-frame hook that routes every
 * Python frame through a per-code-object machine-code stub. Each stub pushes
 * a {prev, self} record onto a per-thread chain whose head lives in a TLS
 * slot at a fixed offset from the thread pointer, so an out-of-process
 * unwinder (BPF) can recover the Python stack without frame pointers.
 *
 * Concurrency: every piece of mutable state is touched with the GIL held
 * (the hook runs with it; exported functions take it), except the chain head,
 * which is per thread. Stubs and arenas are never unmapped or reused.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if PY_VERSION_HEX >= 0x030B0000
#  ifndef Py_BUILD_CORE
#    define Py_BUILD_CORE 1
#    define TRAMPROF_UNDEF_BUILD_CORE 1
#  endif
#  if PY_VERSION_HEX >= 0x030E0000
#    include "internal/pycore_interpframe.h"  /* 3.14+: struct + PyStackRef helpers */
#  else
#    include "internal/pycore_frame.h"
#  endif
#  ifdef TRAMPROF_UNDEF_BUILD_CORE
#    undef Py_BUILD_CORE
#  endif
#else
#  include <frameobject.h>      /* PyFrameObject.f_code (3.9, 3.10) */
#endif

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <inttypes.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "tramprof.h"

#ifndef TRAMPROF_VERSION
#  define TRAMPROF_VERSION "0.0.0"
#endif

#if PY_VERSION_HEX < 0x03090000
#  error "tramprof-trampolines needs CPython 3.9 or newer"
#endif

#if PY_VERSION_HEX >= 0x030B0000
typedef struct _PyInterpreterFrame tramprof_frame;
#else
typedef PyFrameObject tramprof_frame;
#endif

#if PY_VERSION_HEX >= 0x030C0000
#  define tramprof_code_set_extra PyUnstable_Code_SetExtra
#  define tramprof_request_extra_index PyUnstable_Eval_RequestCodeExtraIndex
#else
#  define tramprof_code_set_extra _PyCode_SetExtra
#  define tramprof_request_extra_index _PyEval_RequestCodeExtraIndex
#endif

typedef PyObject *(*tramprof_eval_fn)(PyThreadState *, tramprof_frame *, int);
typedef PyObject *(*tramprof_stub_fn)(PyThreadState *, tramprof_frame *, int, tramprof_eval_fn);

/* ------------------------------------------------------------------------
 * Stub template (x86-64). Offsets are part of the ABI (ABI.md).
 *
 *   0  f3 0f 1e fa             endbr64
 *   4  55                      push   rbp
 *   5  48 89 e5                mov    rbp, rsp
 *   8  48 83 ec 10             sub    rsp, 16          ; record at [rbp-16]
 *  12  64 48 8b 04 25 T32      mov    rax, fs:[T]      ; T = TLS offset (disp32)
 *  21  48 89 45 f0             mov    [rbp-16], rax    ; record.prev = head
 *  25  48 8d 05 e0 ff ff ff    lea    rax, [rip-32]    ; this stub's start
 *  32  48 89 45 f8             mov    [rbp-8], rax     ; record.self
 *  36  48 8d 45 f0             lea    rax, [rbp-16]
 *  40  64 48 89 04 25 T32      mov    fs:[T], rax      ; head = &record
 *  49  ff d1                   call   rcx              ; evaluator(tstate, frame, throwflag)
 *  51  48 8b 4d f0             mov    rcx, [rbp-16]    ; <- return address
 *  55  64 48 89 0c 25 T32      mov    fs:[T], rcx      ; head = record.prev
 *  64  c9                      leave
 *  65  c3                      ret
 *  66  cc ...                  int3 padding up to the stride
 * ---------------------------------------------------------------------- */
#if defined(__x86_64__)
#  define TRAMPROF_ARCH 62
static const unsigned char tramprof_template[] = {
    0xf3, 0x0f, 0x1e, 0xfa,
    0x55,
    0x48, 0x89, 0xe5,
    0x48, 0x83, 0xec, 0x10,
    0x64, 0x48, 0x8b, 0x04, 0x25, 0, 0, 0, 0,
    0x48, 0x89, 0x45, 0xf0,
    0x48, 0x8d, 0x05, 0xe0, 0xff, 0xff, 0xff,
    0x48, 0x89, 0x45, 0xf8,
    0x48, 0x8d, 0x45, 0xf0,
    0x64, 0x48, 0x89, 0x04, 0x25, 0, 0, 0, 0,
    0xff, 0xd1,
    0x48, 0x8b, 0x4d, 0xf0,
    0x64, 0x48, 0x89, 0x0c, 0x25, 0, 0, 0, 0,
    0xc9,
    0xc3,
};
static const size_t tramprof_tls_patch[] = {17, 45, 60};
#  define TRAMPROF_RETURN_OFFSET 51
#  define TRAMPROF_STRIDE 80
#  define TRAMPROF_RECORD_FP_OFFSET 16
#  define TRAMPROF_FILL 0xcc
#elif defined(__aarch64__)
#  define TRAMPROF_ARCH 183
#else
#  define TRAMPROF_ARCH 0
#endif

#define TRAMPROF_ARENA_SIZE (64 * 1024)
#define TRAMPROF_MAX_ARENAS 4096

/* The chain head. initial-exec: a fixed offset from the thread pointer that
 * every thread shares, readable from outside as fsbase + tls_offset. */
static __thread void *tramprof_chain_head __attribute__((tls_model("initial-exec")));

static struct tramprof_arena_range tramprof_arenas[TRAMPROF_MAX_ARENAS];

__attribute__((visibility("default"), used))
struct tramprof_descriptor tramprof_descriptor = {
    .magic = {'T', 'R', 'A', 'M', 'P', 'R', 'O', 'F'},
    .abi_version = TRAMPROF_ABI_VERSION,
    .arch = TRAMPROF_ARCH,
#if defined(__x86_64__)
    .stub_size = sizeof(tramprof_template),
    .stub_stride = TRAMPROF_STRIDE,
    .stub_return_offset = TRAMPROF_RETURN_OFFSET,
    .record_prev_offset = 0,
    .record_self_offset = 8,
    .record_fp_offset = TRAMPROF_RECORD_FP_OFFSET,
#endif
    .arena_capacity = TRAMPROF_MAX_ARENAS,
    .duty_ppm = TRAMPROF_DUTY_ALWAYS,
    .runtime_version = "tramprof-trampolines " TRAMPROF_VERSION,
};

/* Mirror of CPython's _PyCodeObjectExtra (unchanged 3.6 .. 3.15). */
typedef struct {
    Py_ssize_t ce_size;
    void *ce_extras[1];
} tramprof_code_extra;

static Py_ssize_t tramprof_extra_index = -1;
static PyInterpreterState *tramprof_interp;
static int tramprof_mode_value;         /* 0 inactive, else TRAMPROF_MODE_* */
static unsigned char *tramprof_cur_arena;
static size_t tramprof_cur_used;        /* stubs handed out in the current arena */
static int tramprof_map_fd = -1;
static int tramprof_map_wanted;         /* stubs were activated: a map belongs to this process */
static char tramprof_map_path[64];
static char **tramprof_lines;           /* perf map line of every stub, for fork */
static size_t tramprof_nlines, tramprof_cap_lines;

static void
tramprof_seterr(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    if (err == NULL || errlen == 0)
        return;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static void
tramprof_bump_generation(void)
{
    __atomic_add_fetch(&tramprof_descriptor.generation, 1, __ATOMIC_RELEASE);
}

static inline PyCodeObject *
tramprof_frame_code(tramprof_frame *frame)
{
#if PY_VERSION_HEX >= 0x030D0000
    /* 3.13: PyObject *f_executable; 3.14+: _PyStackRef f_executable. */
    PyObject *executable;
#  if PY_VERSION_HEX >= 0x030E0000
    executable = PyStackRef_AsPyObjectBorrow(frame->f_executable);
#  else
    executable = frame->f_executable;
#  endif
    if (executable == NULL || !PyCode_Check(executable))
        return NULL;
    return (PyCodeObject *)executable;
#else
    return frame->f_code;
#endif
}

static inline void *
tramprof_code_get_stub(PyCodeObject *co)
{
#ifdef Py_GIL_DISABLED
    void *value = NULL;
    if (PyUnstable_Code_GetExtra((PyObject *)co, tramprof_extra_index, &value) < 0) {
        PyErr_Clear();
        return NULL;
    }
    return value;
#else
    /* Direct read of co_extra: the GIL is held, the layout is stable. */
    tramprof_code_extra *extra = (tramprof_code_extra *)co->co_extra;
    if (extra != NULL && tramprof_extra_index < extra->ce_size)
        return extra->ce_extras[tramprof_extra_index];
    return NULL;
#endif
}

/* ------------------------------------------------------------------------
 * Perf map
 * ---------------------------------------------------------------------- */
static int
tramprof_write_all(int fd, const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Warnings go to sys.stderr (the GIL is held by every caller). */
static void
tramprof_warn(const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    PySys_WriteStderr("tramprof_trampolines: %s\n", msg);
}

/* Why an existing path is not ours to replace, or NULL if it is: a regular
 * file owned by our euid with a single link (left by an earlier process with
 * the same pid, or by this process before an exec). */
static const char *
tramprof_foreign_reason(const struct stat *st, char *buf, size_t buflen)
{
    if (S_ISLNK(st->st_mode))
        return "it is a symbolic link";
    if (S_ISFIFO(st->st_mode))
        return "it is a FIFO";
    if (S_ISDIR(st->st_mode))
        return "it is a directory";
    if (S_ISSOCK(st->st_mode))
        return "it is a socket";
    if (S_ISCHR(st->st_mode) || S_ISBLK(st->st_mode))
        return "it is a device node";
    if (!S_ISREG(st->st_mode))
        return "it is not a regular file";
    if (st->st_uid != geteuid()) {
        snprintf(buf, buflen, "it is owned by uid %lu, not by this process (uid %lu)",
                 (unsigned long)st->st_uid, (unsigned long)geteuid());
        return buf;
    }
    if (st->st_nlink != 1) {
        snprintf(buf, buflen, "it has %lu hard links", (unsigned long)st->st_nlink);
        return buf;
    }
    return NULL;
}

/* Creates *path* as a new private file (mode 0600) and returns its fd.
 * Never follows a symlink, never blocks on a FIFO, never truncates or
 * writes into an existing file: a stale file of our own is unlinked and the
 * exclusive create retried once; anything else is refused with the reason
 * in *why* (and -1 returned). */
static int
tramprof_create_private(const char *path, int access, char *why, size_t whylen)
{
    const int flags = access | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC;
    char reason[128];
    for (int attempt = 0; attempt < 2; attempt++) {
        int fd = open(path, flags, 0600);
        if (fd >= 0) {
            /* O_EXCL: a new regular file of ours. Writes may block again. */
            int fl = fcntl(fd, F_GETFL);
            if (fl >= 0)
                (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
            return fd;
        }
        if (errno != EEXIST) {
            snprintf(why, whylen, "cannot create it: %s", strerror(errno));
            return -1;
        }
        struct stat st;
        if (lstat(path, &st) != 0) {
            if (errno == ENOENT)
                continue;               /* gone meanwhile: try again */
            snprintf(why, whylen, "it exists and cannot be inspected: %s", strerror(errno));
            return -1;
        }
        const char *bad = tramprof_foreign_reason(&st, reason, sizeof(reason));
        if (bad != NULL) {
            snprintf(why, whylen, "%s", bad);
            return -1;
        }
        if (attempt > 0)
            break;
        /* Ours and stale: replace it (unlink, never truncate). In a sticky
         * /tmp nobody else can swap the name for another file meanwhile. */
        if (unlink(path) != 0 && errno != ENOENT) {
            snprintf(why, whylen, "cannot remove a stale copy: %s", strerror(errno));
            return -1;
        }
    }
    snprintf(why, whylen, "it was created again after removing a stale copy");
    return -1;
}

/* Opens this process's /tmp/perf-<pid>.map and writes every line remembered
 * so far (stubs inherited over fork, or made while no map could be written).
 * On failure: one warning, and the stubs run without a perf map. */
static void
tramprof_open_map(void)
{
    char why[256];
    snprintf(tramprof_map_path, sizeof(tramprof_map_path), "/tmp/perf-%ld.map", (long)getpid());
    int fd = tramprof_create_private(tramprof_map_path, O_WRONLY | O_APPEND, why, sizeof(why));
    if (fd < 0) {
        tramprof_warn("not writing perf map %s: %s; stubs run without a perf map",
                      tramprof_map_path, why);
        return;
    }
    for (size_t i = 0; i < tramprof_nlines; i++) {
        if (tramprof_write_all(fd, tramprof_lines[i], strlen(tramprof_lines[i])) != 0) {
            tramprof_warn("writing perf map %s: %s", tramprof_map_path, strerror(errno));
            break;
        }
    }
    tramprof_map_fd = fd;
}

/* ------------------------------------------------------------------------
 * jitdump (perf's /tmp/jit-<pid>.dump) with .eh_frame unwind info per stub
 * ---------------------------------------------------------------------- */
#define TRAMPROF_JIT_MAGIC 0x4A695444u
#define TRAMPROF_JIT_CODE_LOAD 0
#define TRAMPROF_JIT_UNWINDING_INFO 4
#define TRAMPROF_ALIGN8(x) (((x) + 7u) & ~(size_t)7u)

static int tramprof_jit_fd = -1;
static int tramprof_jit_wanted;         /* jitdump was requested with stubs */
static char tramprof_jit_path[64];
static uint64_t tramprof_jit_index;
static unsigned char tramprof_unwind[128];   /* .eh_frame followed by .eh_frame_hdr */
static size_t tramprof_unwind_size, tramprof_eh_hdr_size;

static uint64_t
tramprof_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void put_u8(unsigned char **p, uint8_t v) { *(*p)++ = v; }
static void put_u32(unsigned char **p, uint32_t v) { memcpy(*p, &v, 4); *p += 4; }
static void put_i32(unsigned char **p, int32_t v) { memcpy(*p, &v, 4); *p += 4; }
static void put_u64(unsigned char **p, uint64_t v) { memcpy(*p, &v, 8); *p += 8; }

#if defined(__x86_64__)
/* CFI of the stub (ABI.md section 3), in the layout perf's genelf gives a
 * jitted ELF: .text at T, .eh_frame at T + ALIGN8(code size), .eh_frame_hdr
 * right after .eh_frame. Pointers are pc-relative (.eh_frame) or relative to
 * .eh_frame_hdr (its table), so one blob serves every stub. */
static void
tramprof_build_unwind(size_t code_size)
{
    unsigned char *p = tramprof_unwind, *cie, *fde, *len, *hdr;
    size_t text_gap = TRAMPROF_ALIGN8(code_size);

    /* CIE */
    cie = p;
    put_u32(&p, 0);                 /* length, patched */
    put_u32(&p, 0);                 /* CIE id */
    put_u8(&p, 1);                  /* version */
    put_u8(&p, 'z'); put_u8(&p, 'R'); put_u8(&p, 0);
    put_u8(&p, 1);                  /* code alignment factor */
    put_u8(&p, 0x78);               /* data alignment factor: sleb128(-8) */
    put_u8(&p, 16);                 /* return address register: rip */
    put_u8(&p, 1);                  /* augmentation data length */
    put_u8(&p, 0x1b);               /* FDE pointers: DW_EH_PE_pcrel | sdata4 */
    put_u8(&p, 0x0c); put_u8(&p, 7); put_u8(&p, 8);   /* def_cfa rsp+8 */
    put_u8(&p, 0x90); put_u8(&p, 1);                  /* offset rip, cfa-8 */
    while ((p - cie) % 8)
        put_u8(&p, 0);              /* DW_CFA_nop */
    len = cie;
    put_u32(&len, (uint32_t)(p - cie - 4));

    /* FDE */
    fde = p;
    put_u32(&p, 0);                 /* length, patched */
    put_u32(&p, (uint32_t)(p - cie));                 /* CIE pointer */
    put_i32(&p, -(int32_t)(text_gap + (size_t)(p - tramprof_unwind)));  /* pc_begin */
    put_u32(&p, (uint32_t)code_size);                 /* pc_range */
    put_u8(&p, 0);                  /* augmentation data length */
    put_u8(&p, 0x40 | 5);           /* advance 5: after push rbp */
    put_u8(&p, 0x0e); put_u8(&p, 16);                 /* def_cfa_offset 16 */
    put_u8(&p, 0x80 | 6); put_u8(&p, 2);              /* offset rbp, cfa-16 */
    put_u8(&p, 0x40 | 3);           /* advance 3 (8): after mov rbp, rsp */
    put_u8(&p, 0x0d); put_u8(&p, 6);                  /* def_cfa_register rbp */
    put_u8(&p, 0x40 | 57);          /* advance 57 (65): after leave */
    put_u8(&p, 0x0c); put_u8(&p, 7); put_u8(&p, 8);   /* def_cfa rsp+8 */
    put_u8(&p, 0xc0 | 6);           /* restore rbp */
    while ((p - fde) % 8)
        put_u8(&p, 0);
    len = fde;
    put_u32(&len, (uint32_t)(p - fde - 4));
    put_u32(&p, 0);                 /* terminator */
    size_t eh_frame_size = (size_t)(p - tramprof_unwind);

    /* .eh_frame_hdr */
    hdr = p;
    put_u8(&p, 1);                  /* version */
    put_u8(&p, 0x1b);               /* eh_frame_ptr: pcrel sdata4 */
    put_u8(&p, 0x03);               /* fde_count: udata4 */
    put_u8(&p, 0x3b);               /* table: datarel sdata4 */
    put_i32(&p, -(int32_t)(eh_frame_size + 4));
    put_u32(&p, 1);
    put_i32(&p, -(int32_t)(text_gap + eh_frame_size));               /* initial location */
    put_i32(&p, (int32_t)(fde - tramprof_unwind) - (int32_t)eh_frame_size);  /* FDE */
    tramprof_eh_hdr_size = (size_t)(p - hdr);
    tramprof_unwind_size = (size_t)(p - tramprof_unwind);
}
#endif

/* UNWINDING_INFO then CODE_LOAD for one stub, in one write(2). */
static void
tramprof_jit_emit(uintptr_t addr, const char *name)
{
    if (tramprof_jit_fd < 0)
        return;
    size_t code_size = tramprof_descriptor.stub_size;
    size_t name_len = strlen(name) + 1;
    size_t unwind_total = 16 + 24 + TRAMPROF_ALIGN8(tramprof_unwind_size);
    size_t load_total = 16 + 40 + name_len + code_size;
    unsigned char *buf = calloc(1, unwind_total + load_total);
    if (buf == NULL)
        return;
    unsigned char *p = buf;
    uint64_t now = tramprof_now_ns();

    put_u32(&p, TRAMPROF_JIT_UNWINDING_INFO);
    put_u32(&p, (uint32_t)unwind_total);
    put_u64(&p, now);
    put_u64(&p, tramprof_unwind_size);
    put_u64(&p, tramprof_eh_hdr_size);
    put_u64(&p, TRAMPROF_ALIGN8(tramprof_unwind_size));
    memcpy(p, tramprof_unwind, tramprof_unwind_size);
    p = buf + unwind_total;

    put_u32(&p, TRAMPROF_JIT_CODE_LOAD);
    put_u32(&p, (uint32_t)load_total);
    put_u64(&p, now);
    put_u32(&p, (uint32_t)getpid());
    put_u32(&p, (uint32_t)syscall(SYS_gettid));
    put_u64(&p, addr);              /* vma */
    put_u64(&p, addr);              /* code_addr */
    put_u64(&p, code_size);
    put_u64(&p, tramprof_jit_index++);
    memcpy(p, name, name_len);
    p += name_len;
    memcpy(p, (const void *)addr, code_size);

    (void)tramprof_write_all(tramprof_jit_fd, (const char *)buf, unwind_total + load_total);
    free(buf);
}

static const char *
tramprof_line_name(const char *line)
{
    const char *sp = strchr(line, ' ');
    return sp ? strchr(sp + 1, ' ') : NULL;
}

/* Opens /tmp/jit-<pid>.dump, writes the header, maps its first page
 * executable (perf notices the file through that mmap event) and emits
 * every stub made so far. On failure: one warning, and no jitdump. */
static void
tramprof_open_jitdump(void)
{
#if defined(__x86_64__)
    char why[256];
    tramprof_build_unwind(tramprof_descriptor.stub_size);
    snprintf(tramprof_jit_path, sizeof(tramprof_jit_path), "/tmp/jit-%ld.dump", (long)getpid());
    /* O_RDWR: the marker mapping below needs read access. */
    int fd = tramprof_create_private(tramprof_jit_path, O_RDWR, why, sizeof(why));
    if (fd < 0) {
        tramprof_warn("not writing jitdump %s: %s; running without a jitdump",
                      tramprof_jit_path, why);
        return;
    }
    unsigned char header[40], *p = header;
    put_u32(&p, TRAMPROF_JIT_MAGIC);
    put_u32(&p, 1);                 /* version */
    put_u32(&p, sizeof(header));
    put_u32(&p, TRAMPROF_ARCH);     /* elf_mach */
    put_u32(&p, 0);
    put_u32(&p, (uint32_t)getpid());
    put_u64(&p, tramprof_now_ns());
    put_u64(&p, 0);                 /* flags */
    void *marker = MAP_FAILED;
    const char *step = "writing";
    if (tramprof_write_all(fd, (const char *)header, sizeof(header)) == 0) {
        step = "mapping";
        marker = mmap(NULL, (size_t)sysconf(_SC_PAGESIZE), PROT_READ | PROT_EXEC,
                      MAP_PRIVATE, fd, 0);
    }
    if (marker == MAP_FAILED) {
        tramprof_warn("%s jitdump %s: %s; running without a jitdump", step,
                      tramprof_jit_path, strerror(errno));
        close(fd);
        (void)unlink(tramprof_jit_path);    /* ours: we just created it */
        return;
    }
    /* The marker mapping is deliberately kept for the life of the process. */
    tramprof_jit_fd = fd;
    tramprof_jit_index = 0;
    for (size_t i = 0; i < tramprof_nlines; i++) {
        const char *name = tramprof_line_name(tramprof_lines[i]);
        if (name == NULL)
            continue;
        char *copy = strdup(name + 1);
        if (copy == NULL)
            continue;
        copy[strcspn(copy, "\n")] = '\0';
        tramprof_jit_emit((uintptr_t)strtoull(tramprof_lines[i], NULL, 16), copy);
        free(copy);
    }
#endif
}

/* Copies s[0:n] (UTF-8) to out with every control character made visible,
 * so a name can never start a new line or carry a terminal escape: bytes
 * below 0x20 and 0x7f become \n, \r, \t or \xNN; the C1 controls
 * U+0080..U+009F and the separators U+2028, U+2029 (line breaks for some
 * readers) become \u00NN, \u2028, \u2029. Everything else is copied, so
 * ordinary names are unchanged. Returns the length written (out == NULL:
 * only measures). */
static size_t
tramprof_escape(char *out, const char *s, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    size_t len = 0;
    char esc[8];
    for (size_t i = 0; i < n; i++) {
        unsigned char b = (unsigned char)s[i];
        size_t elen = 0;
        if (b < 0x20 || b == 0x7f) {
            esc[0] = '\\';
            if (b == '\n' || b == '\r' || b == '\t') {
                esc[1] = b == '\n' ? 'n' : b == '\r' ? 'r' : 't';
                elen = 2;
            } else {
                esc[1] = 'x'; esc[2] = hex[b >> 4]; esc[3] = hex[b & 15];
                elen = 4;
            }
        } else if (b == 0xc2 && i + 1 < n && (unsigned char)s[i + 1] >= 0x80 &&
                   (unsigned char)s[i + 1] <= 0x9f) {
            unsigned char c = (unsigned char)s[++i];
            memcpy(esc, "\\u00", 4); esc[4] = hex[c >> 4]; esc[5] = hex[c & 15];
            elen = 6;
        } else if (b == 0xe2 && i + 2 < n && (unsigned char)s[i + 1] == 0x80 &&
                   ((unsigned char)s[i + 2] == 0xa8 || (unsigned char)s[i + 2] == 0xa9)) {
            memcpy(esc, (unsigned char)s[i + 2] == 0xa8 ? "\\u2028" : "\\u2029", 6);
            elen = 6;
            i += 2;
        }
        if (elen == 0) {
            if (out != NULL)
                out[len] = (char)b;
            len++;
        } else {
            if (out != NULL)
                memcpy(out + len, esc, elen);
            len += elen;
        }
    }
    return len;
}

/* Remember the line (for fork children) and write it, one write(2) per line;
 * the same stub goes to the jitdump when that is on. The line is CPython's
 * "START SIZE py::<qualname>:<filename>" with both names escaped. */
static void
tramprof_emit_stub(uintptr_t addr, const char *qualname, size_t qualname_len,
                   const char *filename, size_t filename_len)
{
    char prefix[64];
    int plen = snprintf(prefix, sizeof(prefix), "%" PRIxPTR " %x py::", addr,
                        (unsigned)tramprof_descriptor.stub_size);
    if (plen <= 0 || (size_t)plen >= sizeof(prefix))
        return;
    size_t qlen = tramprof_escape(NULL, qualname, qualname_len);
    size_t flen = tramprof_escape(NULL, filename, filename_len);
    size_t n = (size_t)plen + qlen + 1 + flen + 1;
    char *line = malloc(n + 1);
    if (line == NULL)
        return;
    char *q = line;
    memcpy(q, prefix, (size_t)plen);
    q += plen;
    q += tramprof_escape(q, qualname, qualname_len);
    *q++ = ':';
    q += tramprof_escape(q, filename, filename_len);
    *q++ = '\n';
    *q = '\0';
    if (tramprof_nlines == tramprof_cap_lines) {
        size_t cap = tramprof_cap_lines ? tramprof_cap_lines * 2 : 1024;
        char **grown = realloc(tramprof_lines, cap * sizeof(*grown));
        if (grown == NULL) {
            free(line);
            return;
        }
        tramprof_lines = grown;
        tramprof_cap_lines = cap;
    }
    tramprof_lines[tramprof_nlines++] = line;
    if (tramprof_map_fd >= 0)
        (void)tramprof_write_all(tramprof_map_fd, line, n);
    if (tramprof_jit_fd >= 0) {
        line[n - 1] = '\0';
        tramprof_jit_emit(addr, tramprof_line_name(line) + 1);
        line[n - 1] = '\n';
    }
}

/* ------------------------------------------------------------------------
 * Arenas
 * ---------------------------------------------------------------------- */
#if defined(__x86_64__)
static int
tramprof_new_arena(void)
{
    uint32_t count = tramprof_descriptor.arena_count;
    if (count >= TRAMPROF_MAX_ARENAS)
        return -1;
    unsigned char *arena = mmap(NULL, TRAMPROF_ARENA_SIZE, PROT_READ | PROT_WRITE,
                                MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (arena == MAP_FAILED)
        return -1;
    int32_t tls = (int32_t)tramprof_descriptor.tls_offset;
    size_t nstubs = TRAMPROF_ARENA_SIZE / TRAMPROF_STRIDE;
    memset(arena, TRAMPROF_FILL, TRAMPROF_ARENA_SIZE);
    for (size_t i = 0; i < nstubs; i++) {
        unsigned char *stub = arena + i * TRAMPROF_STRIDE;
        memcpy(stub, tramprof_template, sizeof(tramprof_template));
        for (size_t p = 0; p < sizeof(tramprof_tls_patch) / sizeof(tramprof_tls_patch[0]); p++)
            memcpy(stub + tramprof_tls_patch[p], &tls, sizeof(tls));
    }
    if (mprotect(arena, TRAMPROF_ARENA_SIZE, PROT_READ | PROT_EXEC) != 0) {
        /* Never unmap: keep the invariant that arenas live forever. It is
         * not registered, so nothing will ever point into it. */
        return -1;
    }
#ifdef PR_SET_VMA
    /* Shows as [anon:tramprof-trampolines] in /proc/PID/maps (best effort). */
    (void)prctl(PR_SET_VMA, PR_SET_VMA_ANON_NAME, (unsigned long)arena, TRAMPROF_ARENA_SIZE,
                (unsigned long)"tramprof-trampolines");
#endif
    tramprof_arenas[count].start = (uint64_t)(uintptr_t)arena;
    tramprof_arenas[count].end = (uint64_t)(uintptr_t)(arena + TRAMPROF_ARENA_SIZE);
    __atomic_store_n(&tramprof_descriptor.arena_count, count + 1, __ATOMIC_RELEASE);
    tramprof_bump_generation();
    tramprof_cur_arena = arena;
    tramprof_cur_used = 0;
    return 0;
}
#endif

/* UTF-8 of a str (it may hold NULs: the length counts), or *fallback*. */
static const char *
tramprof_utf8(PyObject *s, const char *fallback, size_t *len)
{
    Py_ssize_t size = 0;
    const char *u = NULL;
    if (s != NULL && PyUnicode_Check(s)) {
        u = PyUnicode_AsUTF8AndSize(s, &size);
        if (u == NULL)
            PyErr_Clear();
    }
    if (u == NULL) {
        *len = strlen(fallback);
        return fallback;
    }
    *len = (size_t)size;
    return u;
}

/* Slow path: first call of a code object. Never leaves an exception set and
 * never disturbs the one that may be pending (throwflag). */
static tramprof_stub_fn
tramprof_assign_stub(PyCodeObject *co)
{
#if defined(__x86_64__)
    if (tramprof_cur_arena == NULL ||
        tramprof_cur_used >= TRAMPROF_ARENA_SIZE / TRAMPROF_STRIDE) {
        if (tramprof_new_arena() != 0)
            return NULL;
    }
    unsigned char *stub = tramprof_cur_arena + tramprof_cur_used * TRAMPROF_STRIDE;

    /* Park a pending exception (throwflag, generator.throw()) meanwhile. */
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *pending = PyErr_GetRaisedException();
#  define TRAMPROF_RESTORE_PENDING() PyErr_SetRaisedException(pending)
#else
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
#  define TRAMPROF_RESTORE_PENDING() PyErr_Restore(exc_type, exc_value, exc_tb)
#endif
    if (tramprof_code_set_extra((PyObject *)co, tramprof_extra_index, stub) != 0) {
        PyErr_Clear();
        TRAMPROF_RESTORE_PENDING();
        return NULL;
    }
    tramprof_cur_used++;
    __atomic_add_fetch(&tramprof_descriptor.stub_count, 1, __ATOMIC_RELEASE);
    size_t qualname_len, filename_len;
#if PY_VERSION_HEX >= 0x030B0000
    const char *qualname = tramprof_utf8(co->co_qualname, "<unknown>", &qualname_len);
#else
    const char *qualname = tramprof_utf8(co->co_name, "<unknown>", &qualname_len);
#endif
    const char *filename = tramprof_utf8(co->co_filename, "<unknown>", &filename_len);
    tramprof_emit_stub((uintptr_t)stub, qualname, qualname_len, filename, filename_len);
    TRAMPROF_RESTORE_PENDING();
#undef TRAMPROF_RESTORE_PENDING
    return (tramprof_stub_fn)(void *)stub;
#else
    (void)co;
    return NULL;
#endif
}

static void tramprof_duty_start(void);
static void tramprof_cal_maybe_schedule(void);
/* 0: no duty-cycle thread yet, 1: running, -1: could not start one. */
static int tramprof_duty_state;

/* The PEP 523 hook. */
static PyObject *
tramprof_eval(PyThreadState *tstate, tramprof_frame *frame, int throwflag)
{
    if (tramprof_mode_value == TRAMPROF_MODE_STUBS) {
        tramprof_descriptor.hook_calls++;   /* under the GIL */
        if (__builtin_expect((tramprof_descriptor.hook_calls & 4095) == 0, 0))
            tramprof_cal_maybe_schedule();
        if (__builtin_expect(tramprof_duty_state == 0, 0)) {
            uint32_t duty = __atomic_load_n(&tramprof_descriptor.duty_ppm, __ATOMIC_RELAXED);
            if (duty != 0 && duty < TRAMPROF_DUTY_ALWAYS)
                tramprof_duty_start();
        }
        PyCodeObject *co = tramprof_frame_code(frame);
        if (co != NULL) {
            tramprof_stub_fn stub = (tramprof_stub_fn)tramprof_code_get_stub(co);
            if (stub == NULL)
                stub = tramprof_assign_stub(co);
            if (stub != NULL)
                return stub(tstate, frame, throwflag, _PyEval_EvalFrameDefault);
        }
    }
    return _PyEval_EvalFrameDefault(tstate, frame, throwflag);
}

/* ------------------------------------------------------------------------
 * Duty cycle (ABI.md section 8): a profiler that limits the runtime's cost
 * writes duty_ppm; a thread of ours then takes the hook off and puts it back
 * (with the GIL) so that it is on for that share of every window, at a
 * random phase. While it is off, `paused` is 1 and Python calls cost nothing.
 * ---------------------------------------------------------------------- */
#define TRAMPROF_DUTY_TICK_NS 100000000ULL     /* the thread looks this often */
static unsigned tramprof_duty_generation;      /* bumped to retire a thread */

static uint64_t
tramprof_clock_ns(clockid_t clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* While a round runs, the interpreter's eval-frame function is the round's;
 * everything else reads and sets the one that counts (tramprof_cal_saved)
 * through tramprof_get_eval/tramprof_set_eval, and the round puts it back.
 * (A round can let other threads run: CPython drops the GIL now and then.) */
static int tramprof_calibrating;
static _PyFrameEvalFunction tramprof_cal_saved;

static _PyFrameEvalFunction
tramprof_get_eval(PyInterpreterState *interp)
{
    if (tramprof_calibrating && interp == tramprof_interp)
        return tramprof_cal_saved;
    return _PyInterpreterState_GetEvalFrameFunc(interp);
}

static void
tramprof_set_eval(PyInterpreterState *interp, _PyFrameEvalFunction eval)
{
    if (tramprof_calibrating && interp == tramprof_interp)
        tramprof_cal_saved = eval;
    else
        _PyInterpreterState_SetEvalFrameFunc(interp, eval);
}

/* Hook on or off, with the GIL. Leaves any other eval-frame function alone. */
static void
tramprof_duty_switch_locked(int on)
{
    if (tramprof_mode_value != TRAMPROF_MODE_STUBS || tramprof_interp == NULL)
        return;
    _PyFrameEvalFunction current = tramprof_get_eval(tramprof_interp);
    if (on && tramprof_descriptor.paused) {
        if (current != _PyEval_EvalFrameDefault)
            return;
        tramprof_set_eval(tramprof_interp, tramprof_eval);
        uint64_t since = tramprof_descriptor.paused_since_ns;
        uint64_t now = tramprof_clock_ns(CLOCK_MONOTONIC);
        __atomic_store_n(&tramprof_descriptor.off_ns,
                         tramprof_descriptor.off_ns + (now > since ? now - since : 0),
                         __ATOMIC_RELEASE);
        __atomic_store_n(&tramprof_descriptor.paused_since_ns, 0, __ATOMIC_RELEASE);
        __atomic_store_n(&tramprof_descriptor.paused, 0, __ATOMIC_RELEASE);
    } else if (!on && !tramprof_descriptor.paused) {
        if (current != tramprof_eval)
            return;
        /* Paused first: a sample taken from here on names no Python frame. */
        __atomic_store_n(&tramprof_descriptor.paused_since_ns,
                         tramprof_clock_ns(CLOCK_MONOTONIC), __ATOMIC_RELEASE);
        __atomic_store_n(&tramprof_descriptor.paused, 1, __ATOMIC_RELEASE);
        tramprof_set_eval(tramprof_interp, _PyEval_EvalFrameDefault);
    }
}

static int
tramprof_duty_switch(unsigned generation, int on)
{
    if (on == !tramprof_descriptor.paused)
        return 0;
    /* During finalisation this never returns (the thread is ended or parked
     * by CPython), which is what a thread of a dying interpreter should do. */
    PyGILState_STATE gil = PyGILState_Ensure();
    if (generation == __atomic_load_n(&tramprof_duty_generation, __ATOMIC_ACQUIRE))
        tramprof_duty_switch_locked(on);
    PyGILState_Release(gil);
    return 0;
}

/* Sleeps ``ns``; 0 when the thread was retired meanwhile. */
static int
tramprof_duty_sleep(unsigned generation, uint64_t ns)
{
    while (1) {
        if (generation != __atomic_load_n(&tramprof_duty_generation, __ATOMIC_ACQUIRE))
            return 0;
        if (ns == 0)
            return 1;
        uint64_t step = ns < TRAMPROF_DUTY_TICK_NS ? ns : TRAMPROF_DUTY_TICK_NS;
        struct timespec ts = {(time_t)(step / 1000000000ULL), (long)(step % 1000000000ULL)};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
            ;
        ns -= step;
    }
}

/* A rand_r state that differs between processes and between runs. */
static unsigned
tramprof_new_seed(void)
{
    return (unsigned)getpid() ^ (unsigned)tramprof_clock_ns(CLOCK_MONOTONIC);
}

static void *
tramprof_duty_main(void *arg)
{
    unsigned generation = (unsigned)(uintptr_t)arg;
    unsigned seed = tramprof_new_seed();
    while (1) {
        uint32_t duty = __atomic_load_n(&tramprof_descriptor.duty_ppm, __ATOMIC_RELAXED);
        uint64_t window = __atomic_load_n(&tramprof_descriptor.window_us, __ATOMIC_RELAXED);
        window = (window ? window : 1000000) * 1000ULL;
        if (window < 10000000ULL)
            window = 10000000ULL;               /* 10 ms .. 60 s */
        if (window > 60000000000ULL)
            window = 60000000000ULL;
        if (duty == 0 || duty >= TRAMPROF_DUTY_ALWAYS) {
            tramprof_duty_switch(generation, 1);
            if (!tramprof_duty_sleep(generation, TRAMPROF_DUTY_TICK_NS))
                return NULL;
            continue;
        }
        /* On for duty * window, starting at a random point of the window. */
        uint64_t on = window / 1000 * duty / 1000;
        uint64_t start = (uint64_t)rand_r(&seed) % (window - on + 1);
        if (start > 0) {
            tramprof_duty_switch(generation, 0);
            if (!tramprof_duty_sleep(generation, start))
                return NULL;
        }
        tramprof_duty_switch(generation, 1);
        if (!tramprof_duty_sleep(generation, on))
            return NULL;
        if (window - start - on > 0) {
            tramprof_duty_switch(generation, 0);
            if (!tramprof_duty_sleep(generation, window - start - on))
                return NULL;
        }
    }
}

/* With the GIL (from the hook): the profiler asked for a duty cycle. */
static void
tramprof_duty_start(void)
{
    pthread_t thread;
    pthread_attr_t attr;
    unsigned generation = __atomic_add_fetch(&tramprof_duty_generation, 1, __ATOMIC_ACQ_REL);
    tramprof_duty_state = -1;
    if (pthread_attr_init(&attr) != 0)
        return;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    if (pthread_create(&thread, &attr, tramprof_duty_main,
                       (void *)(uintptr_t)generation) == 0)
        tramprof_duty_state = 1;
    pthread_attr_destroy(&attr);
}

/* With the GIL: retire the thread (it ends at its next tick) and make sure
 * the hook is on again, so the caller sees the plain active state. */
static void
tramprof_duty_stop_locked(void)
{
    __atomic_add_fetch(&tramprof_duty_generation, 1, __ATOMIC_ACQ_REL);
    if (tramprof_duty_state == 1)
        tramprof_duty_state = 0;
    tramprof_duty_switch_locked(1);
}

/* ------------------------------------------------------------------------
 * Cost of a call through the hook (ABI.md section 8, call_cost_ps): the extra
 * CPU time of one Python-to-Python call through the hook and a stub, against
 * the default evaluator. One round runs a short recursion without the hook,
 * a copy of it with the hook, then the first again, so that a drift within
 * the round (caches warming after a migration, the clock speed) weighs on
 * both alike. A single round is within about +-25% of what the same process
 * measures over seconds (shared CPUs: caches, frequency, neighbours), and
 * the cost differs from one CPU to the other and from one stretch of
 * seconds to the next, so the published cost is the mean of the middle half
 * of the last rounds, and rounds go on while the program runs: about one a
 * second until TRAMPROF_CAL_KEPT were taken, then about one a minute (~1 ms
 * each). The interval is drawn at random (half to one and a half times
 * that): at a fixed cadence the rounds kept landing at the same point of
 * anything periodic on the machine (a process moved between two CPUs every
 * quarter second: every round ran on the same one for 15 s at a time, and
 * the cost of such stretches differed by up to 1.5x). Later rounds
 * run as pending calls in the main thread, where an exception that a signal
 * handler raises meanwhile goes on to the program, as it would have anyway.
 * ---------------------------------------------------------------------- */
enum {
    TRAMPROF_CAL_DEPTH = 12,        /* fib(12): 465 calls, 12 deep, like call-heavy code */
    TRAMPROF_CAL_FIB_CALLS = 465,
    TRAMPROF_CAL_REPEAT = 20,       /* recursions with the hook, and without (~0.3 ms each) */
    TRAMPROF_CAL_FIRST_ROUNDS = 7,  /* at the first activation */
    TRAMPROF_CAL_FIRST_MAX = 21,    /* tried at most: more while a round is dropped
                                       (moved), or their mean is not yet positive */
    TRAMPROF_CAL_KEPT = 32,         /* rounds the published cost is taken over */
};
#define TRAMPROF_CAL_EARLY_NS 1000000000ULL    /* between rounds (mean), until KEPT rounds */
#define TRAMPROF_CAL_LATE_NS 60000000000ULL    /* between rounds (mean) afterwards */
static PyObject *tramprof_cal_fn[2];           /* the recursions, off and on (kept) */
static PyObject *tramprof_cal_depth;
static int64_t tramprof_cal_costs[TRAMPROF_CAL_KEPT];   /* ps per call, a ring */
static uint64_t tramprof_cal_rounds;           /* rounds recorded so far */
static uint64_t tramprof_cal_dropped;          /* ... and dropped (the thread moved) */
static uint64_t tramprof_cal_next_ns;          /* CLOCK_MONOTONIC of the next round */
static int tramprof_cal_scheduled;             /* a pending call is queued */
static unsigned tramprof_cal_seed;             /* rand_r state of the intervals */
static int tramprof_cal_seeded;                /* ... drawn in this process (0 again after fork) */
/* With the GIL: the recursions, compiled once. 0, or -1 with an exception.
 * Two copies of one function: one only ever runs without the hook, the
 * other only with it, so each stays specialised for its evaluator as a
 * program's code does. (One function run both ways is de-specialised by
 * every switch, and measured 25-30% below the cost a program pays.) */
static int
tramprof_cal_prepare(void)
{
    if (tramprof_cal_fn[0] != NULL)
        return 0;
    PyObject *globals = PyDict_New();
    PyObject *code = Py_CompileString(
        "def _tramprof_calibrate_off(n):\n"
        "    return n if n < 2 else _tramprof_calibrate_off(n - 1) + "
        "_tramprof_calibrate_off(n - 2)\n"
        "def _tramprof_calibrate_on(n):\n"
        "    return n if n < 2 else _tramprof_calibrate_on(n - 1) + "
        "_tramprof_calibrate_on(n - 2)\n",
        "<tramprof calibration>", Py_file_input);
    PyObject *depth = PyLong_FromLong(TRAMPROF_CAL_DEPTH);
    int rc = -1;
    if (globals != NULL && code != NULL && depth != NULL &&
        PyDict_SetItemString(globals, "__builtins__", PyEval_GetBuiltins()) == 0) {
        PyObject *done = PyEval_EvalCode(code, globals, globals);
        PyObject *off = done ? PyDict_GetItemString(globals, "_tramprof_calibrate_off") : NULL;
        PyObject *on = done ? PyDict_GetItemString(globals, "_tramprof_calibrate_on") : NULL;
        Py_XDECREF(done);
        if (off != NULL && on != NULL) {
            Py_INCREF(off);
            Py_INCREF(on);
            tramprof_cal_fn[0] = off;
            tramprof_cal_fn[1] = on;
            tramprof_cal_depth = depth;
            depth = NULL;
            rc = 0;
        } else if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "calibration functions missing");
        }
    }
    Py_XDECREF(depth);
    Py_XDECREF(code);
    Py_XDECREF(globals);
    return rc;
}

/* With the GIL: one round. 0 with the extra ps per call in *cost; 1 when it
 * could not measure (another eval-frame function was installed meanwhile,
 * which is then left alone); 2 when the thread moved to another CPU during
 * it (its parts then ran at different speeds: on a shared virtual machine
 * the same recursion ran up to 1.7x slower from one process to the next,
 * ten times the hook's cost on 3.9); -1 with an exception set. */
static int
tramprof_cal_round(PyInterpreterState *interp, int64_t *cost)
{
    uint64_t spent[2] = {0, 0};
    _PyFrameEvalFunction mine = NULL;
    int rc = 0;
    int cpu = sched_getcpu();
    int moved = 0;
    tramprof_cal_saved = _PyInterpreterState_GetEvalFrameFunc(interp);
    tramprof_calibrating = 1;
    /* Without the hook, with it, without it again: half the repeats each
     * time without it, so that both sets sit around the same middle. */
    static const int order[3] = {0, 1, 0};
    for (int step = 0; step < 3 && rc == 0; step++) {
        int on = order[step];
        int repeat = on ? TRAMPROF_CAL_REPEAT : TRAMPROF_CAL_REPEAT / 2;
        if (mine != NULL && _PyInterpreterState_GetEvalFrameFunc(interp) != mine) {
            rc = 1;
            break;
        }
        mine = on ? tramprof_eval : _PyEval_EvalFrameDefault;
        _PyInterpreterState_SetEvalFrameFunc(interp, mine);
        uint64_t calls = tramprof_descriptor.hook_calls;
        uint64_t began = tramprof_clock_ns(CLOCK_THREAD_CPUTIME_ID);
        for (int i = 0; i < repeat && rc == 0; i++) {
            PyObject *result = PyObject_CallOneArg(tramprof_cal_fn[on], tramprof_cal_depth);
            if (result == NULL)
                rc = -1;
            Py_XDECREF(result);
        }
        spent[on] += tramprof_clock_ns(CLOCK_THREAD_CPUTIME_ID) - began;
        moved |= sched_getcpu() != cpu;
        if (on && rc == 0 && tramprof_descriptor.hook_calls >= calls + (uint64_t)(
                TRAMPROF_CAL_REPEAT * TRAMPROF_CAL_FIB_CALLS))
            /* hook_calls counts the program's calls, not these */
            tramprof_descriptor.hook_calls -= TRAMPROF_CAL_REPEAT * TRAMPROF_CAL_FIB_CALLS;
    }
    tramprof_calibrating = 0;
    if (_PyInterpreterState_GetEvalFrameFunc(interp) == mine)
        _PyInterpreterState_SetEvalFrameFunc(interp, tramprof_cal_saved);
    else if (rc == 0)
        rc = 1;
    if (rc == 0 && moved)
        rc = 2;
    if (rc == 0)
        *cost = ((int64_t)spent[1] - (int64_t)spent[0]) * 1000 /
                (TRAMPROF_CAL_REPEAT * TRAMPROF_CAL_FIB_CALLS);
    return rc;
}

/* Keeps a round's cost and publishes the mean of the middle half of the
 * kept ones: robust to a round that a preemption or a migration upset, as a
 * median is, but where the rounds fall in two groups (two CPUs, two
 * stretches of time) it lies between them, as the program's cost does, not
 * on whichever group has one round more. */
static void
tramprof_cal_record(int64_t cost)
{
    tramprof_cal_costs[tramprof_cal_rounds % TRAMPROF_CAL_KEPT] = cost;
    tramprof_cal_rounds++;
    unsigned n = tramprof_cal_rounds < TRAMPROF_CAL_KEPT
        ? (unsigned)tramprof_cal_rounds : TRAMPROF_CAL_KEPT;
    int64_t sorted[TRAMPROF_CAL_KEPT];
    for (unsigned i = 0; i < n; i++) {
        unsigned j = i;
        for (; j > 0 && sorted[j - 1] > tramprof_cal_costs[i]; j--)
            sorted[j] = sorted[j - 1];
        sorted[j] = tramprof_cal_costs[i];
    }
    unsigned trim = n / 4;
    int64_t sum = 0;
    for (unsigned i = trim; i < n - trim; i++)
        sum += sorted[i];
    int64_t mean = sum / (int64_t)(n - 2 * trim);
    if (mean > 0)
        __atomic_store_n(&tramprof_descriptor.call_cost_ps, (uint64_t)mean, __ATOMIC_RELAXED);
}

/* Drops the exception a round's own calls can raise (the program may be
 * near its recursion limit, or out of memory); 1 if it was one of those. */
static int
tramprof_cal_own_error(void)
{
    if (PyErr_ExceptionMatches(PyExc_RecursionError) ||
        PyErr_ExceptionMatches(PyExc_MemoryError)) {
        PyErr_Clear();
        return 1;
    }
    return 0;
}

/* The wait before the next round: about a second until the kept rounds
 * were taken, then about a minute, drawn from half to one and a half times
 * that. */
static uint64_t
tramprof_cal_interval_ns(void)
{
    if (!tramprof_cal_seeded) {
        tramprof_cal_seed = tramprof_new_seed();
        tramprof_cal_seeded = 1;
    }
    uint64_t mean = tramprof_cal_rounds < TRAMPROF_CAL_KEPT
        ? TRAMPROF_CAL_EARLY_NS : TRAMPROF_CAL_LATE_NS;
    uint64_t draw = (uint64_t)rand_r(&tramprof_cal_seed) % 1000;   /* 0..999 */
    return mean / 2 + mean / 1000 * draw;
}

/* At the first activation, with the GIL and the default evaluator. Where
 * the hook is cheap against the noise of a shared CPU (3.9: ~7 ns a call),
 * seven rounds can leave no positive mean (one start in about twenty),
 * and a program that makes few calls would then publish no cost until it
 * made thousands: more rounds run until there is one, up to a bound. Even
 * 21 rounds can leave none on a loaded machine (one 3.9 start in a hundred
 * with both CPUs busy): the cost then stays unknown until later rounds find
 * it, which they do while the program makes calls, the only case where it
 * weighs. */
static void
tramprof_calibrate(PyInterpreterState *interp)
{
    if (tramprof_cal_prepare() == 0) {
        int recorded = 0;
        for (int round = 0; round < TRAMPROF_CAL_FIRST_MAX && (
                 recorded < TRAMPROF_CAL_FIRST_ROUNDS || tramprof_descriptor.call_cost_ps == 0);
             round++) {
            int64_t cost;
            int rc = tramprof_cal_round(interp, &cost);
            if (rc == 2) {
                tramprof_cal_dropped++;
                continue;
            }
            if (rc != 0)
                break;
            tramprof_cal_record(cost);
            recorded++;
        }
    }
    if (PyErr_Occurred())
        PyErr_Clear();
    tramprof_cal_next_ns = tramprof_clock_ns(CLOCK_MONOTONIC) + tramprof_cal_interval_ns();
}

/* A later round, as a pending call (main thread, GIL, no exception set). */
static int
tramprof_cal_pending(void *arg)
{
    (void)arg;
    tramprof_cal_scheduled = 0;
    PyThreadState *tstate = PyThreadState_Get();
    PyInterpreterState *interp = tstate->interp;
    if (tramprof_mode_value != TRAMPROF_MODE_STUBS || interp != tramprof_interp ||
        tramprof_cal_fn[0] == NULL || tramprof_calibrating ||
        tstate->c_tracefunc != NULL || tstate->c_profilefunc != NULL ||
        _PyInterpreterState_GetEvalFrameFunc(interp) != tramprof_eval)
        return 0;   /* not now (paused, traced, replaced): at the next chance */
    int64_t cost;
    int rc = tramprof_cal_round(interp, &cost);
    if (rc == 0)
        tramprof_cal_record(cost);
    else if (rc == 2)
        tramprof_cal_dropped++;
    else if (rc < 0 && !tramprof_cal_own_error())
        return -1;  /* e.g. KeyboardInterrupt: the program's, raised where it runs */
    return 0;
}

/* From the hook, every 4096 calls: queues a round when one is due. */
static void
tramprof_cal_maybe_schedule(void)
{
    if (tramprof_cal_scheduled || tramprof_calibrating || tramprof_cal_fn[0] == NULL)
        return;
    uint64_t now = tramprof_clock_ns(CLOCK_MONOTONIC);
    if (now < tramprof_cal_next_ns)
        return;
    tramprof_cal_next_ns = now + tramprof_cal_interval_ns();
    if (Py_AddPendingCall(tramprof_cal_pending, NULL) == 0)
        tramprof_cal_scheduled = 1;
}

/* ------------------------------------------------------------------------
 * Exported API (called through cffi, which releases the GIL: take it back).
 * ---------------------------------------------------------------------- */
static int
tramprof_activate_locked(int mode, int jitdump, char *err, size_t errlen)
{
    if (mode != TRAMPROF_MODE_STUBS && mode != TRAMPROF_MODE_HOOK_ONLY) {
        tramprof_seterr(err, errlen, "unknown mode %d", mode);
        return -1;
    }
#ifdef Py_GIL_DISABLED
    tramprof_seterr(err, errlen, "free-threaded CPython builds are not supported");
    return -1;
#endif
#if !defined(__x86_64__)
    if (mode == TRAMPROF_MODE_STUBS) {
        tramprof_seterr(err, errlen,
                        "tramprof-trampolines has no stubs for this architecture "
                        "(only x86-64 is supported)");
        return -1;
    }
#endif
    PyInterpreterState *interp = PyThreadState_Get()->interp;
    _PyFrameEvalFunction current = tramprof_get_eval(interp);
    if (tramprof_mode_value == mode && tramprof_descriptor.paused && interp == tramprof_interp)
        return 0;   /* active, the duty cycle has the hook off for now */
    if (current == tramprof_eval) {
        if (tramprof_mode_value == mode)
            return 0;
        tramprof_seterr(err, errlen, "already active in another mode; deactivate() first");
        return -1;
    }
    if (current != _PyEval_EvalFrameDefault) {
        tramprof_seterr(err, errlen,
                        "another eval-frame function (PEP 523) is installed, e.g. by a "
                        "debugger, a JIT or CPython's -X perf; refusing to replace it");
        return -1;
    }
    if (tramprof_interp != NULL && tramprof_interp != interp) {
        tramprof_seterr(err, errlen, "only one interpreter per process is supported");
        return -1;
    }
    if (tramprof_extra_index < 0) {
        Py_ssize_t index = tramprof_request_extra_index(NULL);
        if (index < 0) {
            PyErr_Clear();
            tramprof_seterr(err, errlen, "no free co_extra slot (too many users)");
            return -1;
        }
        tramprof_extra_index = index;
    }
#if defined(__x86_64__)
    if (tramprof_descriptor.tls_offset < INT32_MIN || tramprof_descriptor.tls_offset > INT32_MAX) {
        tramprof_seterr(err, errlen, "TLS slot out of disp32 range (offset %lld)",
                        (long long)tramprof_descriptor.tls_offset);
        return -1;
    }
#endif
    tramprof_interp = interp;

#if defined(__x86_64__)
    /* A map or jitdump path that is not ours to write (ABI.md section 5) is
     * a warning, never an error: the stubs run without that file. An open
     * file is kept across deactivate()/activate(); a refused one is tried
     * again on the next activation. */
    if (mode == TRAMPROF_MODE_STUBS) {
        tramprof_map_wanted = 1;
        if (tramprof_map_fd < 0)
            tramprof_open_map();
        if (jitdump) {
            tramprof_jit_wanted = 1;
            if (tramprof_jit_fd < 0)
                tramprof_open_jitdump();
        }
    }
#endif
    tramprof_descriptor.pid = (uint32_t)getpid();
    tramprof_mode_value = mode;
    if (mode == TRAMPROF_MODE_STUBS)
        __atomic_store_n(&tramprof_descriptor.state, 1, __ATOMIC_RELEASE);
    tramprof_bump_generation();
    if (mode == TRAMPROF_MODE_STUBS && tramprof_descriptor.call_cost_ps == 0)
        tramprof_calibrate(interp);
    tramprof_set_eval(interp, tramprof_eval);
    return 0;
}

int
tramprof_activate(int mode, int jitdump, char *err, size_t errlen)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    int rc = tramprof_activate_locked(mode, jitdump, err, errlen);
    PyGILState_Release(gil);
    return rc;
}

int
tramprof_deactivate(char *err, size_t errlen)
{
    int rc = 0;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyInterpreterState *interp = PyThreadState_Get()->interp;
    tramprof_duty_stop_locked();
    _PyFrameEvalFunction current = tramprof_get_eval(interp);
    if (current == tramprof_eval) {
        tramprof_set_eval(interp, _PyEval_EvalFrameDefault);
        if (tramprof_descriptor.state == 1)
            __atomic_store_n(&tramprof_descriptor.state, 2, __ATOMIC_RELEASE);
        tramprof_bump_generation();
    } else if (tramprof_mode_value != 0) {
        tramprof_seterr(err, errlen,
                        "the eval-frame function was replaced by someone else; leaving it");
        rc = -1;
    }
    /* Frames already running keep returning through their stubs: nothing
     * is freed. */
    tramprof_mode_value = 0;
    PyGILState_Release(gil);
    return rc;
}

int
tramprof_is_active(void)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    int active = tramprof_mode_value != 0 && tramprof_interp != NULL &&
        (tramprof_get_eval(tramprof_interp) == tramprof_eval ||
         tramprof_descriptor.paused);
    PyGILState_Release(gil);
    return active;
}

int
tramprof_mode(void)
{
    return tramprof_mode_value;
}

/* In a fork child (os.fork): a new perf map (and jitdump) for the new pid,
 * holding every stub the child inherited. Problems are warnings. */
int
tramprof_after_fork_child(char *err, size_t errlen)
{
    (void)err;
    (void)errlen;
    PyGILState_STATE gil = PyGILState_Ensure();
    if (tramprof_map_fd >= 0) {
        close(tramprof_map_fd);
        tramprof_map_fd = -1;
    }
    if (tramprof_map_wanted)
        tramprof_open_map();
    if (tramprof_jit_fd >= 0) {
        close(tramprof_jit_fd);
        tramprof_jit_fd = -1;
    }
    if (tramprof_jit_wanted)
        tramprof_open_jitdump();
    /* The duty-cycle thread did not survive the fork: the hook goes back on
     * (the hook starts a new thread if the child gets a duty cycle too). */
    tramprof_duty_stop_locked();
    __atomic_store_n(&tramprof_descriptor.duty_ppm, TRAMPROF_DUTY_ALWAYS, __ATOMIC_RELAXED);
    __atomic_store_n(&tramprof_descriptor.hook_calls, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&tramprof_descriptor.off_ns, 0, __ATOMIC_RELAXED);
    tramprof_cal_scheduled = 0;
    tramprof_cal_seeded = 0;    /* not the parent's waits */
    if (tramprof_descriptor.state != 0 || tramprof_mode_value != 0) {
        tramprof_descriptor.pid = (uint32_t)getpid();
        tramprof_bump_generation();
    }
    PyGILState_Release(gil);
    return 0;
}

/* Measurement rounds of call_cost_ps taken so far (for tests). */
uint64_t
tramprof_calibration_rounds(void)
{
    return __atomic_load_n(&tramprof_cal_rounds, __ATOMIC_RELAXED);
}

/* Measurement rounds dropped so far because the thread moved (for tests). */
uint64_t
tramprof_calibration_dropped(void)
{
    return __atomic_load_n(&tramprof_cal_dropped, __ATOMIC_RELAXED);
}

/* Stub addresses on the current thread's chain, innermost first. */
int
tramprof_debug_chain(uint64_t *out, int max)
{
    int n = 0;
    uintptr_t record = (uintptr_t)tramprof_chain_head;
    while (record != 0 && n < max) {
        out[n++] = *(uint64_t *)(record + tramprof_descriptor.record_self_offset);
        record = *(uintptr_t *)(record + tramprof_descriptor.record_prev_offset);
    }
    return n;
}

/* The stub assigned to a code object (its address as a Python id()), 0 if none. */
uint64_t
tramprof_stub_for_code(void *code)
{
    uint64_t stub = 0;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *co = (PyObject *)code;
    if (tramprof_extra_index >= 0 && PyCode_Check(co))
        stub = (uint64_t)(uintptr_t)tramprof_code_get_stub((PyCodeObject *)co);
    PyGILState_Release(gil);
    return stub;
}

int
tramprof_jitdump_path(char *out, size_t outlen)
{
    if (tramprof_jit_fd < 0)
        return -1;
    snprintf(out, outlen, "%s", tramprof_jit_path);
    return 0;
}

int
tramprof_perf_map_path(char *out, size_t outlen)
{
    if (tramprof_map_fd < 0)
        return -1;
    snprintf(out, outlen, "%s", tramprof_map_path);
    return 0;
}

/* The thread pointer. __builtin_thread_pointer needs GCC 11 on x86-64; the
 * x86-64 TLS ABI guarantees that the word at %fs:0 is the thread pointer. */
static void *
tramprof_thread_pointer(void)
{
    void *tp;
#if defined(__x86_64__)
    __asm__("mov %%fs:0, %0" : "=r"(tp));
#elif defined(__aarch64__)
    __asm__("mrs %0, tpidr_el0" : "=r"(tp));
#else
    tp = __builtin_thread_pointer();
#endif
    return tp;
}

/* Runs when the extension is loaded (dlopen): the descriptor is complete
 * before anyone activates, so a reader can find it at once. */
__attribute__((constructor)) static void
tramprof_init_descriptor(void)
{
    tramprof_descriptor.tls_offset =
        (int64_t)((char *)&tramprof_chain_head - (char *)tramprof_thread_pointer());
    tramprof_descriptor.arenas = (uint64_t)(uintptr_t)tramprof_arenas;
    tramprof_descriptor.pid = (uint32_t)getpid();
    snprintf(tramprof_descriptor.python_version, sizeof(tramprof_descriptor.python_version),
             "%s", PY_VERSION);
}
