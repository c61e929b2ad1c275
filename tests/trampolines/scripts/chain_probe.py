"""Compares the C-side chain (tramprof_trampolines._debug_chain) with the
Python call stack in many situations; prints one JSON list of probes.

Each probe records the chain (stub addresses, innermost first, without the
_debug_chain frame itself), the stubs of the frames on the Python stack
(stub_address of each f_code, from sys._getframe outwards) and those frames'
perf-map names, so the test can check both by address and by perf map.
"""

import asyncio
import contextlib
import json
import sys
import threading

import tramprof_trampolines as t

probes = []


def qualname(code):
    return getattr(code, "co_qualname", code.co_name)


def probe(label):
    chain = t._debug_chain()
    own = t.stub_address(t._debug_chain.__code__)
    frames = []
    f = sys._getframe()
    while f is not None:
        frames.append(f.f_code)
        f = f.f_back
    probes.append({
        "label": label,
        "thread": threading.current_thread().name,
        "first_is_debug_chain": bool(chain) and chain[0] == own,
        "chain": chain[1:],
        "expected": [t.stub_address(code) for code in frames],
        "names": [f"py::{qualname(code)}:{code.co_filename}" for code in frames],
    })


def nested_a():
    nested_b()


def nested_b():
    nested_c()


def nested_c():
    probe("nested")


def gen_probe():
    yield 1
    probe("generator")
    yield 2


def deep(n):
    if n == 0:
        probe("deep")
    else:
        deep(n - 1)


def raise_deep(n):
    if n == 0:
        raise ValueError(n)
    raise_deep(n - 1)


async def co_leaf():
    await asyncio.sleep(0)
    probe("coroutine")


async def co_main():
    await asyncio.gather(co_leaf(), co_leaf())


async def agen():
    await asyncio.sleep(0)
    probe("async generator")
    yield 1


async def agen_main():
    return [x async for x in agen()]


def traced():
    probe("settrace")


def in_thread(barrier, i):
    barrier.wait()
    for _ in range(50):
        nested_a()
    deep(20 + i)


def main():
    nested_a()
    g = gen_probe()
    next(g)
    next(g)
    g.close()
    deep(300)
    for _ in range(3):
        with contextlib.suppress(ValueError):
            raise_deep(30)
    probe("after exceptions")
    asyncio.run(co_main())
    asyncio.run(agen_main())
    sys.settrace(lambda *a: None)
    traced()
    sys.settrace(None)
    sys.setprofile(lambda *a: None)
    nested_a()
    sys.setprofile(None)
    barrier = threading.Barrier(4)
    threads = [threading.Thread(target=in_thread, args=(barrier, i), name=f"worker-{i}")
               for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    probe("end")
    print(json.dumps({"active": t.is_active(), "probes": probes,
                      "map": t.perf_map_path()}))


if __name__ == "__main__":
    main()
