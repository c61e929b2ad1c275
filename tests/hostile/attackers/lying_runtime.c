/* A fake trampoline runtime: the descriptor it exports claims one arena of
 * 1 GiB (262,144 pages), as a process would to fill the BPF stub-page map.
 * Built as .../tramprof_trampolines/_runtime.so so the daemon takes it for ours. */
#include <stdint.h>
#include <string.h>
#include <unistd.h>

struct arena { uint64_t start, end; };

static struct arena arenas[1] = {{0x10000000ULL, 0x10000000ULL + (1ULL << 30)}};

struct descriptor {
    char magic[8];
    uint32_t abi_version, arch, stub_size, stub_stride, stub_return_offset, state;
    int64_t tls_offset;
    uint32_t record_prev_offset, record_self_offset;
    int32_t record_fp_offset;
    uint32_t pid;
    uint64_t arenas_address;
    uint32_t arena_count, arena_capacity;
    uint64_t stub_count, generation;
    char runtime_version[32];
    char python_version[16];
};

struct descriptor tramprof_descriptor = {
    .magic = "TRAMPROF", .abi_version = 1, .arch = 62, .stub_size = 16, .stub_stride = 32,
    .stub_return_offset = 12, .state = 1, .tls_offset = -64, .record_prev_offset = 0,
    .record_self_offset = 8, .record_fp_offset = 16, .arena_count = 1, .arena_capacity = 1,
    .stub_count = 1, .generation = 1, .runtime_version = "9.9.9", .python_version = "3.11.2",
};

__attribute__((constructor)) static void publish(void)
{
    tramprof_descriptor.pid = (uint32_t)getpid();
    tramprof_descriptor.arenas_address = (uint64_t)(uintptr_t)arenas;
}

/* Runs in the library, so samples land in it and the daemon re-reads the
 * process's maps (as they do when a real runtime starts running stubs). */
void spin(void)
{
    for (;;)
        __asm__ volatile("" ::: "memory");
}
