/* Unit-test target for separate debug files and demangling: C++ functions
 * in namespaces, templates, an anonymous namespace and a class, plus a
 * file-local C function. Prints the addresses of a few of them as
 * "0x... 0x... 0x...\n", then blocks until stdin reaches EOF. */
#include <cstdio>
#include <string>
#include <unistd.h>
#include <vector>

namespace tramprof_unit {
namespace detail {

template <typename T, int N>
struct Accumulator {
	__attribute__((noinline)) T add(const std::vector<T> &values) const
	{
		T sum = N;
		for (const T &v : values)
			sum += v;
		return sum;
	}
};

} // namespace detail

template <typename K>
__attribute__((noinline)) std::string describe(K key, const char *what)
{
	return std::string(what) + std::to_string(key);
}

class Walker {
public:
	__attribute__((noinline)) virtual long step(long x) const { return x * 3 + 1; }
	virtual ~Walker() = default;
};

} // namespace tramprof_unit

namespace {
__attribute__((noinline)) int hidden_helper(int x)
{
	volatile int acc = x;
	return acc * 7;
}
} // namespace

extern "C" __attribute__((noinline, used)) int tramprof_unit_c_static_like(int x)
{
	return hidden_helper(x) + 1;
}

int main()
{
	using tramprof_unit::detail::Accumulator;
	Accumulator<long, 3> acc;
	tramprof_unit::Walker walker;
	long (tramprof_unit::Walker::*step)(long) const = &tramprof_unit::Walker::step;
	std::printf("%p %p %p\n",
		    reinterpret_cast<void *>(&tramprof_unit::describe<unsigned long>),
		    reinterpret_cast<void *>(&hidden_helper),
		    reinterpret_cast<void *>(&tramprof_unit_c_static_like));
	std::fflush(stdout);
	char buf[64];
	while (read(0, buf, sizeof(buf)) > 0)
		;
	std::vector<long> values{1, 2, 3};
	return static_cast<int>(acc.add(values) + (walker.*step)(2) +
				tramprof_unit::describe<unsigned long>(7UL, "k").size() +
				tramprof_unit_c_static_like(1));
}
