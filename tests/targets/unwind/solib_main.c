/* main -> chain_a -> lib_b -> lib_c, lib_* in libtpchain.so.
 *
 *   solib_main SECONDS          linked against libtpchain.so
 *   solib_main SECONDS dlopen   loads ./libtpchain.so (next to the program)
 *                               with dlopen after "ready" and a line on stdin
 */
#include <dlfcn.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef DLOPEN_ONLY
void lib_b(double until);
#endif

static volatile unsigned long sink;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) void chain_a(void (*callee)(double), double until)
{
    callee(until);
    sink += 1;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 30.0;
    void (*callee)(double);
    printf("ready\n");
    fflush(stdout);
#ifdef DLOPEN_ONLY
    char line[16], path[4096];
    if (!fgets(line, sizeof line, stdin))
        return 1;
    snprintf(path, sizeof path, "%s/libtpchain.so", dirname(strdup(argv[0])));
    void *lib = dlopen(path, RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    callee = (void (*)(double))dlsym(lib, "lib_b");
#else
    callee = lib_b;
#endif
    chain_a(callee, now() + seconds);
    return 0;
}
