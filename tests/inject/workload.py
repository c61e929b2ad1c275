"""A multi-threaded CPU workload for injection tests (any CPython 3.9+).

    workload.py THREADS SECONDS

Prints ``ready`` once its threads run, then works until SECONDS passed or a
``stop`` line arrives on stdin. Each thread i calls outer_i -> middle ->
inner -> leaf over and over (every call is new, so frames entered after an
injection run under trampolines). The main thread polls stdin every 20 ms,
so it reaches the interpreter's safe points often. At the end it prints
what must not depend on profiling: every thread's results for its first
rounds, and a deterministic run of generators, exceptions, closures and
classes.
"""

import select
import sys
import threading
import time

ROUNDS_CHECKED = 20


def leaf(seed):
    total = seed
    for i in range(3000):
        total = (total * 31 + i) % 1000003
    return total


def inner(seed):
    return leaf(seed)


def middle(seed):
    return inner(seed)


def make_outer(index):
    namespace = {"middle": middle}
    exec(f"def outer_{index}(seed):\n    return middle(seed)\n", namespace)
    return namespace[f"outer_{index}"]


def semantics():
    def gen(n):
        for i in range(n):
            try:
                if i % 3 == 0:
                    raise ValueError(i)
                yield i * i
            except ValueError as exc:
                yield -int(str(exc))

    class Acc:
        def __init__(self):
            self.items = []

        def __call__(self, value):
            self.items.append(value)
            return len(self.items)

    acc = Acc()
    closures = [(lambda k: (lambda x: x + k))(k) for k in range(5)]  # noqa: B023
    for value in gen(12):
        acc(sum(f(value) for f in closures))
    return acc.items


def main():
    threads, seconds = int(sys.argv[1]), float(sys.argv[2])
    stop = threading.Event()
    results = {}

    def work(index, outer):
        mine = []
        seed = index
        while not stop.is_set() or len(mine) < ROUNDS_CHECKED:
            seed = outer(seed)
            if len(mine) < ROUNDS_CHECKED:
                mine.append(seed)
        results[index] = mine

    workers = [threading.Thread(target=work, args=(i, make_outer(i)), name=f"worker-{i}")
               for i in range(threads)]
    for worker in workers:
        worker.start()
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        readable, _, _ = select.select([sys.stdin], [], [], 0.02)
        if readable and sys.stdin.readline().strip() in ("stop", ""):
            break
    stop.set()
    for worker in workers:
        worker.join()
    for index in sorted(results):
        print(index, results[index])
    print("semantics", semantics())


main()
