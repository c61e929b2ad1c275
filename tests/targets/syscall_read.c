/* Spends its time in the kernel: read() from /dev/zero in a loop, called
 * from a known non-leaf chain main -> read_loop. Runs for argv[1] seconds. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static char buf[1 << 16];

__attribute__((noinline)) static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) void read_loop(int fd, double until)
{
    while (now() < until)
        for (int i = 0; i < 100; i++)
            if (read(fd, buf, sizeof(buf)) < 0)
                exit(1);
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 30.0;
    int fd = open("/dev/zero", O_RDONLY);
    if (fd < 0)
        return 1;
    printf("ready\n");
    fflush(stdout);
    read_loop(fd, now() + seconds);
    return 0;
}
