"""CPU-bound Python work for overhead benchmarks.

    pywork.py ROUNDS    fixed work, then exit
    pywork.py stream    run until killed, printing the rounds done every 0.25 s
"""

import sys
import time


def leaf(n):
    x = 0
    for i in range(n):
        x = (x * 31 + i) & 0xFFFF
    return x


def inner(n):
    return leaf(n)


def middle(n):
    return inner(n) + inner(n // 2)


def outer(rounds):
    total = 0
    for _ in range(rounds):
        total += middle(20000)
    return total


def stream():
    done = 0
    next_report = time.monotonic() + 0.25
    while True:
        outer(10)
        done += 10
        now = time.monotonic()
        if now >= next_report:
            print(f"{now:.6f} {done}", flush=True)
            next_report = now + 0.25


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "stream":
        stream()
    else:
        outer(int(sys.argv[1]) if len(sys.argv) > 1 else 400)
