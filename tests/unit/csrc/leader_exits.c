/* The main thread starts a worker and exits (pthread_exit); the process runs
 * on in the worker. Once the main thread has gone, the worker prints the
 * address of a function of this executable, then waits for stdin to close.
 */
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

__attribute__((noinline)) void tramprof_unit_worker_leaf(void)
{
    __asm__ volatile("");
}

static void *worker(void *main_thread)
{
    char c;
    pthread_join(*(pthread_t *)main_thread, NULL);
    printf("%lx\n", (unsigned long)tramprof_unit_worker_leaf);
    fflush(stdout);
    while (read(0, &c, 1) > 0)
        ;
    tramprof_unit_worker_leaf();
    _exit(0);
}

int main(void)
{
    static pthread_t self;
    pthread_t thread;
    self = pthread_self();
    if (pthread_create(&thread, NULL, worker, &self) != 0)
        return 1;
    pthread_exit(NULL);
}
