"""Deterministic workload whose observable behaviour must not change with the
runtime active: prints one JSON document (plus whether the runtime is active).

Covers nested/recursive calls (counted by hand and with sys.setprofile),
sys.settrace line events, generators, coroutines, async generators,
exceptions and tracebacks, deep recursion and RecursionError, contextlib.
"""

import asyncio
import collections
import contextlib
import json
import sys
import traceback

counts = collections.Counter()
results = {}


def count(name):
    counts[name] += 1


# --- nested calls --------------------------------------------------------
def fib(n):
    count("fib")
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def is_even(n):
    count("is_even")
    return True if n == 0 else is_odd(n - 1)


def is_odd(n):
    count("is_odd")
    return False if n == 0 else is_even(n - 1)


class Shape:
    def __init__(self, size):
        count("Shape.__init__")
        self.size = size

    @property
    def area(self):
        count("Shape.area")
        return self.size * self.size

    def __repr__(self):
        return f"Shape({self.size})"


class Square(Shape):
    def __init__(self, size):
        count("Square.__init__")
        super().__init__(size)


def decorate(fn):
    def wrapper(*args, **kwargs):
        count("wrapper")
        return fn(*args, **kwargs)
    return wrapper


@decorate
def add(a, b=1, *rest, scale=1):
    count("add")
    return (a + b + sum(rest)) * scale


def calls():
    results["fib"] = fib(16)
    results["even"] = [is_even(n) for n in range(30)]
    results["areas"] = sum(Square(i).area for i in range(50))
    results["add"] = [add(1), add(1, 2), add(1, 2, 3, 4, scale=3)]
    results["lambda"] = sorted(range(20), key=lambda x: (x % 3, -x))
    results["closure"] = [f() for f in [(lambda i=i: i * i) for i in range(5)]]


def profiled():
    events = collections.Counter()

    def prof(frame, event, arg):
        if event in ("call", "return"):
            events[f"{event}:{frame.f_code.co_name}"] += 1
        elif event in ("c_call", "c_return"):
            events[event] += 1

    sys.setprofile(prof)
    try:
        fib(10)
        list(gen_squares(5))
        [Square(i).area for i in range(3)]
    finally:
        sys.setprofile(None)
    results["profile_events"] = dict(sorted(events.items()))

    lines = []

    def tracer(frame, event, arg):
        if frame.f_code.co_name == "traced":
            lines.append((event, frame.f_lineno - traced.__code__.co_firstlineno))
        return tracer

    sys.settrace(tracer)
    try:
        traced(4)
    finally:
        sys.settrace(None)
    results["trace_lines"] = lines


def traced(n):
    total = 0
    for i in range(n):
        if i % 2:
            total += i
        else:
            total -= 1
    return total


# --- generators -----------------------------------------------------------
def gen_squares(n):
    for i in range(n):
        count("gen_squares")
        yield i * i


def echo():
    log = []
    try:
        value = yield "ready"
        while True:
            try:
                value = yield f"got {value!r}"
            except ValueError as exc:
                log.append(f"caught {exc}")
                value = yield "recovered"
    except GeneratorExit:
        log.append("closed")
        results["echo_log"] = log
        raise
    finally:
        log.append("finally")


def delegate():
    result = yield from inner()
    yield f"inner returned {result}"
    return "delegate done"


def inner():
    yield 1
    yield 2
    return 3


def generators():
    results["squares"] = list(gen_squares(10))
    results["genexp"] = sum(x for x in range(100) if x % 7 == 0)
    g = echo()
    out = [next(g), g.send(1), g.send("two"), g.throw(ValueError("boom")), g.send(3)]
    g.close()
    out.append(g.gi_frame is None)
    results["echo"] = out
    d = delegate()
    results["delegate"] = list(d)
    d2 = delegate()
    next(d2)
    try:
        d2.throw(KeyError("x"))
    except KeyError as exc:
        results["delegate_throw"] = repr(exc)
    stop = None
    it = inner()
    try:
        while True:
            next(it)
    except StopIteration as exc:
        stop = exc.value
    results["stop_value"] = stop


# --- coroutines and async generators -----------------------------------------
async def leaf(i):
    await asyncio.sleep(0)
    count("leaf")
    if i == 3:
        raise LookupError(f"leaf {i}")
    return i * 10


async def middle(i):
    try:
        return await leaf(i)
    except LookupError as exc:
        return f"handled {exc}"


async def ticker(n):
    try:
        for i in range(n):
            await asyncio.sleep(0)
            received = yield i
            if received:
                yield f"echo {received}"
    finally:
        results.setdefault("ticker_finally", 0)
        results["ticker_finally"] += 1


async def never_finishes():
    await asyncio.sleep(3600)


async def amain():
    out = {}
    out["gather"] = await asyncio.gather(*(middle(i) for i in range(6)))
    out["afor"] = [x async for x in ticker(5)]
    agen = ticker(10)
    out["asend"] = [await agen.__anext__(), await agen.asend("hi"), await agen.__anext__()]
    try:
        await agen.athrow(RuntimeError("into agen"))
    except RuntimeError as exc:
        out["athrow"] = str(exc)
    await agen.aclose()
    task = asyncio.ensure_future(never_finishes())
    await asyncio.sleep(0)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        out["cancelled"] = task.cancelled()
    try:
        await asyncio.wait_for(never_finishes(), 0.01)
    except asyncio.TimeoutError:
        out["timeout"] = True
    return out


def manual_coroutine():
    async def co():
        x = await Awaitable()
        return x + 1

    class Awaitable:
        def __await__(self):
            value = yield "suspended"
            return value

    c = co()
    first = c.send(None)
    try:
        c.send(41)
    except StopIteration as exc:
        return [first, exc.value]


def coroutines():
    results["async"] = asyncio.run(amain())
    results["manual_coroutine"] = manual_coroutine()


# --- exceptions -------------------------------------------------------------
def raiser(depth):
    if depth == 0:
        raise ValueError("bottom")
    return raiser(depth - 1)


def chained():
    try:
        raiser(3)
    except ValueError as exc:
        raise KeyError("wrapped") from exc


def exceptions():
    try:
        chained()
    except KeyError as exc:
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
        results["traceback"] = [line for line in "".join(tb).splitlines()
                                if not line.startswith("    ") or "raise" in line]
        results["cause"] = repr(exc.__cause__)
    flow = []
    for i in range(4):
        try:
            try:
                if i % 2:
                    raiser(i)
                flow.append(f"ok {i}")
            finally:
                flow.append(f"finally {i}")
        except ValueError:
            flow.append(f"except {i}")
        else:
            flow.append(f"else {i}")
    results["flow"] = flow
    try:
        [1 / (i - 5) for i in range(10)]
    except ZeroDivisionError as exc:
        results["zde"] = str(exc)
    try:
        next(g for g in gen_raises())
    except TypeError as exc:
        results["gen_raises"] = str(exc)


def gen_raises():
    yield from ()
    raise TypeError("from generator")


# --- recursion ---------------------------------------------------------------
def depth(n):
    return 0 if n == 0 else 1 + depth(n - 1)


def unbounded(n):
    try:
        return unbounded(n + 1)
    except RecursionError:
        return n


def recursion():
    results["depth_900"] = depth(900)
    results["recursion_error_at"] = unbounded(0)
    results["depth_900_again"] = depth(900)


# --- contextlib ----------------------------------------------------------------
@contextlib.contextmanager
def managed(log, name):
    log.append("enter " + name)
    try:
        yield name.upper()
    except ZeroDivisionError:
        log.append("swallowed in " + name)
    finally:
        log.append("exit " + name)


def contexts():
    log = []
    with contextlib.ExitStack() as stack:
        values = [stack.enter_context(managed(log, n)) for n in "abc"]
        log.append(f"body {values}")
    with managed(log, "z"):
        1 / 0  # noqa: B018 - raises inside the context manager
    results["contexts"] = log


def main():
    calls()
    profiled()
    generators()
    coroutines()
    exceptions()
    recursion()
    contexts()
    results["counts"] = dict(sorted(counts.items()))
    active = None
    if "tramprof_trampolines" in sys.modules:
        active = sys.modules["tramprof_trampolines"].is_active()
    print(json.dumps({"active": active, "results": results}, sort_keys=True, default=repr))


if __name__ == "__main__":
    main()
