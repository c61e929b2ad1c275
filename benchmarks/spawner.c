/* Starts short-lived processes at a fixed rate: spawner RATE PROGRAM [ARG...]
 * fork()s and exec()s PROGRAM RATE times per second until killed, and reaps
 * them. Every child dies with the spawner (PR_SET_PDEATHSIG), so none
 * outlives a benchmark that was killed. Built by bench_busy_node.py. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: spawner RATE PROGRAM [ARG...]\n");
        return 2;
    }
    double rate = atof(argv[1]);
    if (rate <= 0 || rate > 10000) {
        fprintf(stderr, "spawner: RATE must be in (0, 10000]\n");
        return 2;
    }
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() == 1)
        return 1; /* the parent is already gone */
    long step_ns = (long)(1e9 / rate);
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    for (;;) {
        next.tv_nsec += step_ns;
        while (next.tv_nsec >= 1000000000L) {
            next.tv_nsec -= 1000000000L;
            next.tv_sec++;
        }
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
        pid_t pid = fork();
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            execv(argv[2], argv + 2);
            _exit(127);
        }
        while (waitpid(-1, NULL, WNOHANG) > 0)
            ;
    }
}
