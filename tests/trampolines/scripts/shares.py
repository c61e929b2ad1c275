"""Three call-heavy recursions with fixed shares of the work (a 50%, b 30%,
c 20%), forever. Prints "ready"; then each "mark" line on stdin is answered
with "<process CPU seconds> <rounds done>"; "off" and "on" deactivate and
activate the trampoline runtime (answered with "ok"); "stop" ends it."""

import sys
import threading
import time


def a_rec(n):
    return n if n < 2 else a_rec(n - 1) + a_rec(n - 2)


def b_rec(n):
    return n if n < 2 else b_rec(n - 1) + b_rec(n - 2)


def c_rec(n):
    return n if n < 2 else c_rec(n - 1) + c_rec(n - 2)


done = [0]
stopping = [False]  # a plain flag: the loop calls nothing but the three recursions


def work_loop():
    while not stopping[0]:
        a_rec(16)
        a_rec(16)
        a_rec(15)
        b_rec(16)
        b_rec(15)
        c_rec(16)
        done[0] += 1


def answer():
    for line in sys.stdin:
        if line.strip() == "mark":
            print(f"{time.process_time():.6f} {done[0]}", flush=True)
        elif line.strip() in ("off", "on"):
            import tramprof_trampolines
            if line.strip() == "off":
                tramprof_trampolines.deactivate()
            else:
                tramprof_trampolines.activate()
            print("ok", flush=True)
        elif line.strip() == "stop":
            break
    stopping[0] = True


threading.Thread(target=answer, daemon=True).start()
print("ready", flush=True)
work_loop()
