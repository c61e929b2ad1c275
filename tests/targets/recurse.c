/* Recurses to changing depths and spins at the bottom, so the sampler sees
 * many distinct user stacks (map-full and truncation tests).
 * Usage: recurse SECONDS MAX_DEPTH. Prints "ready" once started. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static volatile unsigned long sink;

__attribute__((noinline)) static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) void spin(void)
{
    double until = now() + 0.002;
    unsigned long x = 1;
    while (now() < until)
        for (int i = 0; i < 10000; i++)
            x = x * 6364136223846793005UL + 1;
    sink += x;
}

__attribute__((noinline)) void descend(int depth)
{
    if (depth > 1)
        descend(depth - 1);
    else
        spin();
    sink++;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 30.0;
    int max_depth = argc > 2 ? atoi(argv[2]) : 100;
    double until = now() + seconds;
    printf("ready\n");
    fflush(stdout);
    for (int i = 0; now() < until; i++)
        descend(i % max_depth + 1);
    return 0;
}
