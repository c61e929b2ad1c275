/* Spins in a known call chain main -> chain_a -> chain_b -> chain_c.
 *
 * Every function on the chain calls another function, so none is a leaf:
 * GCC omits the frame pointer setup of leaf functions even with
 * -fno-omit-frame-pointer on some versions, which would hide the caller.
 * Runs for argv[1] seconds (default 30), printing "ready" once started.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static volatile unsigned long sink;

__attribute__((noinline)) static void rarely(unsigned long x)
{
    sink += x;
}

__attribute__((noinline)) static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) void chain_c(double until)
{
    unsigned long x = 1;
    while (now() < until) {
        for (int i = 0; i < 2000000; i++) {
            x = x * 6364136223846793005UL + 1442695040888963407UL;
            if ((x >> 60) == 0xF && (x & 0xFFFFF) == 0)
                rarely(x);
        }
    }
    sink += x;
}

__attribute__((noinline)) void chain_b(double until)
{
    chain_c(until);
    rarely(2);
}

__attribute__((noinline)) void chain_a(double until)
{
    chain_b(until);
    rarely(1);
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 30.0;
    printf("ready\n");
    fflush(stdout);
    chain_a(now() + seconds);
    return 0;
}
