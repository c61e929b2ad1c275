"""Fixed CPU-bound Python work for overhead benchmarks (argv[1] rounds)."""

import sys


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


if __name__ == "__main__":
    outer(int(sys.argv[1]) if len(sys.argv) > 1 else 400)
