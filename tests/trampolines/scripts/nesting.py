"""Profiling target: known Python call chains, spinning in pure Python.

    nesting.py chain SECONDS      outer -> middle -> inner -> leaf
    nesting.py recurse SECONDS N  descend() N deep, spinning at the bottom
    nesting.py threads SECONDS    thread A in alpha_work, thread B in beta_work
    nesting.py zlib SECONDS       compress_loop -> zlib.compress (native leaf)
    nesting.py mix SECONDS        work_a, work_b, work_c in a 3:2:1 ratio of time
    nesting.py sorted SECONDS     sort_loop -> sorted() (native) -> sort_key (Python)
    nesting.py grow SECONDS N     waits for a line on stdin, then makes N new
                                  functions (their stubs fill new arenas), prints
                                  "grown" and spins: grow -> fresh<N-1> -> leaf

Prints "ready" once the work is running (threads started).
"""

import sys
import threading
import time
import zlib


def leaf(until):
    x = 0
    while time.monotonic() < until:
        for i in range(10000):
            x = (x * 31 + i) & 0xFFFF
    return x


def inner(until):
    return leaf(until)


def middle(until):
    return inner(until)


def outer(until):
    return middle(until)


def descend(depth, until):
    if depth > 1:
        return descend(depth - 1, until)
    return leaf(until)


def alpha_work(until):
    return leaf(until)


def beta_work(until):
    return leaf(until)


def spin(n):
    x = 0
    for i in range(n):
        x = (x * 31 + i) & 0xFFFF
    return x


def work_a():
    return spin(30000)


def work_b():
    return spin(20000)


def work_c():
    return spin(10000)


def mix(until):
    while time.monotonic() < until:
        work_a()
        work_b()
        work_c()


def compress_loop(until):
    data = bytes(range(256)) * 4096
    n = 0
    while time.monotonic() < until:
        n += len(zlib.compress(data, 9))
    return n


def sort_key(item):
    x = item
    for _ in range(20):
        x = (x * 31 + 7) & 0xFFFF
    return x


def sort_loop(until):
    data = list(range(2000))
    n = 0
    while time.monotonic() < until:
        n += sorted(data, key=sort_key)[0]
    return n


def grow(seconds, count):
    sys.stdin.readline()
    made = {}
    for i in range(count):
        exec(f"def fresh{i}(until):\n    return leaf(until)\n", globals(), made)
        made[f"fresh{i}"](0)  # its first call makes its stub
    print("grown", flush=True)
    return made[f"fresh{count - 1}"](time.monotonic() + seconds)


def main():
    mode, seconds = sys.argv[1], float(sys.argv[2])
    until = time.monotonic() + seconds
    if mode == "threads":
        threads = [threading.Thread(target=alpha_work, args=(until,), name="alpha"),
                   threading.Thread(target=beta_work, args=(until,), name="beta")]
        for t in threads:
            t.start()
        print("ready", flush=True)
        for t in threads:
            t.join()
        return
    print("ready", flush=True)
    if mode == "chain":
        outer(until)
    elif mode == "recurse":
        sys.setrecursionlimit(10000)
        descend(int(sys.argv[3]), until)
    elif mode == "zlib":
        compress_loop(until)
    elif mode == "mix":
        mix(until)
    elif mode == "sorted":
        sort_loop(until)
    elif mode == "grow":
        grow(seconds, int(sys.argv[3]))


if __name__ == "__main__":
    main()
