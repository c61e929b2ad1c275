/* The main thread starts a worker and exits (pthread_exit); the process runs
 * on in the worker. Once the main thread has gone, the worker prints the
 * address of a function of this executable, then waits for stdin to close.
 *
 * With a library path as argv[1], each 'n' read from stdin makes the worker
 * start another and exit: the next one waits for it to have gone, loads the
 * library (dlopen) and prints the address of its tramprof_lib_func. So the
 * process runs on in one thread after another, none of them the first.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

static const char *library;
static pthread_t previous;   /* the thread the next worker waits for */

__attribute__((noinline)) void tramprof_unit_worker_leaf(void)
{
    __asm__ volatile("");
}

static void *worker(void *first)
{
    char c;
    pthread_join(previous, NULL);
    if (first) {
        printf("%lx\n", (unsigned long)tramprof_unit_worker_leaf);
    } else {
        void *lib = dlopen(library, RTLD_NOW);
        void *func = lib ? dlsym(lib, "tramprof_lib_func") : NULL;
        if (func == NULL) {
            fprintf(stderr, "%s\n", dlerror());
            _exit(1);
        }
        printf("%lx\n", (unsigned long)func);
    }
    fflush(stdout);
    while (read(0, &c, 1) > 0) {
        pthread_t next;
        if (c != 'n' || library == NULL)
            continue;
        previous = pthread_self();
        if (pthread_create(&next, NULL, worker, NULL) != 0)
            _exit(1);
        pthread_exit(NULL);
    }
    tramprof_unit_worker_leaf();
    _exit(0);
}

int main(int argc, char **argv)
{
    pthread_t thread;
    library = argc > 1 ? argv[1] : NULL;
    previous = pthread_self();
    if (pthread_create(&thread, NULL, worker, (void *)1) != 0)
        return 1;
    pthread_exit(NULL);
}
