/* main -> chain_a -> chain_b -> chain_c, chain_c from nocfi_leaf.c (no CFI). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void chain_c(double until);
static volatile unsigned long sink;

__attribute__((noinline)) void chain_b(double until)
{
    chain_c(until);
    sink += 1;
}

__attribute__((noinline)) void chain_a(double until)
{
    chain_b(until);
    sink += 2;
}

int main(int argc, char **argv)
{
    struct timespec ts;
    double seconds = argc > 1 ? atof(argv[1]) : 30.0;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    printf("ready\n");
    fflush(stdout);
    chain_a(ts.tv_sec + ts.tv_nsec / 1e9 + seconds);
    return 0;
}
