/* Unit-test target: dlopen()s the library named by argv[1], prints the
 * address of its tramprof_lib_func as "0x...\n", then blocks until stdin
 * reaches EOF. Lets the test delete or replace the library file while it is
 * still mapped. */
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	char buf[64];
	void *handle;
	void *func;

	if (argc != 2)
		return 2;
	handle = dlopen(argv[1], RTLD_NOW);
	if (!handle) {
		fprintf(stderr, "dlopen: %s\n", dlerror());
		return 1;
	}
	func = dlsym(handle, "tramprof_lib_func");
	if (!func) {
		fprintf(stderr, "dlsym: %s\n", dlerror());
		return 1;
	}
	printf("%p\n", func);
	fflush(stdout);
	while (read(0, buf, sizeof(buf)) > 0)
		;
	return 0;
}
