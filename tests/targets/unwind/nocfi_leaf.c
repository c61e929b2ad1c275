/* chain_c without any call-frame information (built with
 * -fno-asynchronous-unwind-tables -fno-unwind-tables -fomit-frame-pointer):
 * no unwinder can know where its caller is. */
#include <time.h>

static volatile unsigned long sink;

__attribute__((noinline)) void chain_c(double until)
{
    unsigned long x = 1;
    struct timespec ts;
    do {
        for (int i = 0; i < 2000000; i++)
            x = x * 6364136223846793005UL + 1442695040888963407UL;
        clock_gettime(CLOCK_MONOTONIC, &ts);
    } while (ts.tv_sec + ts.tv_nsec / 1e9 < until);
    sink += x;
}
