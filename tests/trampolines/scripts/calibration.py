"""The runtime's later cost measurements (pending calls in the main thread):
while the program runs, then under a signal handler that raises every 2 ms
(a round takes about 1 ms: about half of them are interrupted), then under
a profile function. Prints one JSON line."""

import json
import signal
import sys
import time

import tramprof_trampolines as runtime


class Tick(Exception):
    pass


def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)


armed = False
raised = 0


def on_alarm(signum, frame):
    # Raises only inside the try below (armed there), so every Tick raised
    # must reach the except clause: one lost in a measurement round would not.
    global armed, raised
    if armed:
        armed = False
        raised += 1
        raise Tick


rounds_at_start = runtime._debug_calibration_rounds()
dropped_at_start = runtime._debug_calibration_dropped()
deadline = time.monotonic() + 3.5
while time.monotonic() < deadline:
    fib(12)
rounds_running = runtime._debug_calibration_rounds()
signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
caught = 0
deadline = time.monotonic() + 4.0
while time.monotonic() < deadline:
    try:
        armed = True
        for _ in range(50):
            fib(12)
        armed = False
    except Tick:
        caught += 1
signal.setitimer(signal.ITIMER_REAL, 0, 0)
armed = False
rounds_with_signals = runtime._debug_calibration_rounds()

names = set()


def profile(frame, event, arg):
    if event == "call":
        names.add(frame.f_code.co_name)


sys.setprofile(profile)
deadline = time.monotonic() + 2.5
while time.monotonic() < deadline:
    fib(12)
sys.setprofile(None)
rounds_profiled = runtime._debug_calibration_rounds()

print(json.dumps({"raised": raised, "caught": caught, "rounds": [
    rounds_at_start, rounds_running, rounds_with_signals, rounds_profiled],
    "dropped_at_start": dropped_at_start,
    "profiled_names": sorted(names)}))
