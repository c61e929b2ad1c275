/* Spins in a known call chain main -> chain_a -> chain_b -> chain_c.
 *
 * Every function on the chain calls another function, so none is a leaf:
 * GCC omits the frame pointer setup of leaf functions even with
 * -fno-omit-frame-pointer on some versions, which would hide the caller.
 * Runs for argv[1] seconds (default 30), printing "ready" once started.
 * With "orphan" as argv[2], the main thread starts a thread that runs
 * orphan -> chain_a -> chain_b -> chain_c and exits (pthread_exit); the
 * process runs on in that thread, which prints "ready" once the main thread
 * has gone.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

static double seconds = 30.0;
static pthread_t main_thread;

__attribute__((noinline)) static void *orphan(void *unused)
{
    (void)unused;
    pthread_join(main_thread, NULL);
    printf("ready\n");
    fflush(stdout);
    chain_a(now() + seconds);
    rarely(3);
    exit(0);
}

int main(int argc, char **argv)
{
    pthread_t thread;
    if (argc > 1)
        seconds = atof(argv[1]);
    if (argc > 2 && strcmp(argv[2], "orphan") == 0) {
        main_thread = pthread_self();
        if (pthread_create(&thread, NULL, orphan, NULL) != 0)
            return 1;
        pthread_exit(NULL);
    }
    printf("ready\n");
    fflush(stdout);
    chain_a(now() + seconds);
    return 0;
}
