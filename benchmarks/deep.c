/* Spins at a fixed native depth: deep SECONDS FRAMES. The stack is
 * _start, libc's two start-up frames, main, then descend() until FRAMES
 * frames are on it; the leaf spins. Built with and without frame pointers
 * by bench_tables.py. Prints "ready" once started. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static volatile unsigned long sink;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) void descend(int depth, double until)
{
    if (depth > 1) {
        descend(depth - 1, until);
        sink += depth; /* not a tail call: every level keeps its frame */
        return;
    }
    unsigned long x = 1;
    while (now() < until)
        for (int i = 0; i < 1000000; i++)
            x = x * 6364136223846793005UL + 1442695040888963407UL;
    sink += x;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 30.0;
    int frames = argc > 2 ? atoi(argv[2]) : 32;
    printf("ready\n");
    fflush(stdout);
    descend(frames > 5 ? frames - 4 : 1, now() + seconds);
    return 0;
}
