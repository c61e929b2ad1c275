/* Fixed CPU-bound work for overhead benchmarks: argv[1] million iterations
 * of an LCG inside a non-leaf call chain. Exits when done. */
#include <stdlib.h>

static volatile unsigned long sink;

__attribute__((noinline)) static void rarely(unsigned long x) { sink += x; }

__attribute__((noinline)) static void work_inner(long millions)
{
    unsigned long x = 1;
    for (long m = 0; m < millions; m++) {
        for (int i = 0; i < 1000000; i++) {
            x = x * 6364136223846793005UL + 1442695040888963407UL;
            if ((x >> 60) == 0xF && (x & 0xFFFFF) == 0)
                rarely(x);
        }
    }
    sink += x;
}

__attribute__((noinline)) static void work_outer(long millions)
{
    work_inner(millions);
    rarely(1);
}

int main(int argc, char **argv)
{
    work_outer(argc > 1 ? atol(argv[1]) : 1000);
    return 0;
}
