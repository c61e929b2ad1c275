// Spins in main -> chain_a -> chain_b -> chain_c, where chain_c throws and
// catches a C++ exception on every round: samples land in the compute loop
// and in libstdc++ / libgcc_s unwinding code, all below chain_c.
// Built with plain g++ -O2 (no frame pointers). Prints "ready" once started.
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <stdexcept>

static volatile unsigned long sink;

static double now()
{
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) void thrower(unsigned long x)
{
    if (x & 1)
        throw std::runtime_error("odd");
    sink += x;
}

__attribute__((noinline)) void chain_c(double until)
{
    unsigned long x = 1;
    while (now() < until) {
        for (int i = 0; i < 20000; i++)
            x = x * 6364136223846793005UL + 1442695040888963407UL;
        try {
            thrower(x);
        } catch (const std::exception &) {
            sink += 1;
        }
    }
}

__attribute__((noinline)) void chain_b(double until)
{
    chain_c(until);
    sink += 2;
}

__attribute__((noinline)) void chain_a(double until)
{
    chain_b(until);
    sink += 3;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 30.0;
    std::printf("ready\n");
    std::fflush(stdout);
    chain_a(now() + seconds);
    return 0;
}
