/* Unit-test target for tramprof.symbols.usersyms.
 *
 * Prints the addresses of two functions (one global, one file-local) as
 * "0x... 0x...\n", then blocks until stdin reaches EOF so the test can
 * symbolize the live process and end it by closing the pipe. */
#include <stdio.h>
#include <unistd.h>

__attribute__((noinline, used)) int tramprof_unit_leaf(int x)
{
	volatile int acc = x;
	for (int i = 0; i < x; i++)
		acc = acc * 31 + i;
	return acc;
}

__attribute__((noinline, used)) static int tramprof_unit_static(int x)
{
	volatile int acc = x;
	for (int i = 0; i < x; i += 2)
		acc ^= acc << 3 | i;
	return acc;
}

int main(void)
{
	char buf[64];

	printf("%p %p\n", (void *)tramprof_unit_leaf, (void *)tramprof_unit_static);
	fflush(stdout);
	while (read(0, buf, sizeof(buf)) > 0)
		;
	return tramprof_unit_leaf(0) + tramprof_unit_static(0);
}
