/* lib_b -> lib_c, spinning in lib_c: the middle of a chain that runs through
 * a shared library built without frame pointers (plain -O2). */
#include <time.h>

static volatile unsigned long sink;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) void lib_c(double until)
{
    unsigned long x = 1;
    while (now() < until) {
        for (int i = 0; i < 2000000; i++)
            x = x * 6364136223846793005UL + 1442695040888963407UL;
    }
    sink += x;
}

__attribute__((noinline)) void lib_b(double until)
{
    lib_c(until);
    sink += 1;
}
