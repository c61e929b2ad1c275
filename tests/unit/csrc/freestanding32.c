/* A 32-bit freestanding program (no libc needed, so it builds without a
 * multilib sysroot) for the ELFCLASS32 parsing tests. */

__attribute__((noinline, used)) int tramprof_fs32_func(int x)
{
	volatile int acc = x;
	for (int i = 0; i < x; i++)
		acc = acc * 3 + i;
	return acc;
}

void _start(void)
{
	for (;;)
		tramprof_fs32_func(1);
}
