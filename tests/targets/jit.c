/* A tiny "JIT": copies a frame-pointer-keeping spin loop into anonymous
 * executable memory, names it in /tmp/perf-PID.map the way CPython does, and
 * calls it from main -> jit_caller in a loop for argv[1] seconds.
 * With argv[2] = "nomap" it writes no map. With argv[2] = "late" the code's
 * page stays writable while it spins natively (native_spin) for argv[3]
 * seconds first, as a JIT's new code page is writable until the code is in it.
 * After printing "ready <address>" it waits for a line on stdin (so a test
 * can prepare files), then spins. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

/* push rbp; mov rbp,rsp; mov rax,rdi; 1: dec rax; jnz 1b; pop rbp; ret */
static const unsigned char spin_code[] = {
    0x55, 0x48, 0x89, 0xe5, 0x48, 0x89, 0xf8,
    0x48, 0xff, 0xc8, 0x75, 0xfb,
    0x5d, 0xc3,
};

typedef void (*spin_fn)(long);

__attribute__((noinline)) static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) void native_spin(double until)
{
    volatile unsigned long x = 0;
    while (now() < until)
        for (int i = 0; i < 100000; i++)
            x = x * 31 + i;
}

__attribute__((noinline)) void jit_caller(spin_fn fn, double until)
{
    while (now() < until)
        fn(1000000);
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 30.0;
    /* Put the code in the middle of a page so lookups must use the map's
     * exact range, not the mapping start. */
    unsigned char *mem = mmap(NULL, 4096, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED)
        return 1;
    unsigned char *code = mem + 0x400;
    memcpy(code, spin_code, sizeof(spin_code));
    int late = argc > 2 && strcmp(argv[2], "late") == 0;
    if (!late && mprotect(mem, 4096, PROT_READ | PROT_EXEC) != 0)
        return 1;

    int write_map = !(argc > 2 && strcmp(argv[2], "nomap") == 0);
    printf("ready %p\n", (void *)code);
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof(line), stdin))
        return 1;

    char path[64];
    snprintf(path, sizeof(path), "/tmp/perf-%d.map", getpid());
    if (write_map) {
        FILE *map = fopen(path, "a");
        if (!map)
            return 1;
        fprintf(map, "%lx %zx py::spin:/srv/app/jit target.py\n", (unsigned long)code,
                sizeof(spin_code));
        fclose(map);
    }
    double until = now() + seconds;
    if (late) {
        native_spin(now() + (argc > 3 ? atof(argv[3]) : 1.0));
        if (mprotect(mem, 4096, PROT_READ | PROT_EXEC) != 0)
            return 1;
    }
    jit_caller((spin_fn)code, until);
    if (write_map)
        unlink(path);
    return 0;
}
