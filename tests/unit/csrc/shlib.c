/* Shared library for the ELF and user-space symbolization unit tests.
 *
 * Exercises the symbol-table corner cases the parser must get right:
 * an exported function, a file-local one, a strong symbol with a weak alias
 * at the same address, and an assembly function without a .size (zero-size
 * symbol, which must extend to the next symbol). */

__attribute__((noinline, used)) static int tramprof_lib_local(int x)
{
	volatile int acc = x;
	for (int i = 0; i < x; i++)
		acc += acc * 7 + i;
	return acc;
}

__attribute__((noinline)) int tramprof_lib_func(int x)
{
	volatile int acc = x;
	for (int i = 0; i < x; i++)
		acc = acc * 13 + i;
	return acc + tramprof_lib_local(x);
}

int tramprof_lib_strong(int x)
{
	volatile int acc = x;
	for (int i = 0; i < x; i++)
		acc = acc * 17 - i;
	return acc;
}

int tramprof_lib_weak_alias(int x) __attribute__((weak, alias("tramprof_lib_strong")));

__asm__(".text\n"
	".globl tramprof_lib_nosize\n"
	".type tramprof_lib_nosize, @function\n"
	"tramprof_lib_nosize:\n"
	"\tnop\n\tnop\n\tnop\n\tnop\n"
	"\tnop\n\tnop\n\tnop\n\tnop\n"
	"\tret\n");
