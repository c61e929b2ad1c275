"""activate/deactivate/hook-only transitions; prints one JSON line."""

import json
import sys

import tramprof_trampolines as t


def f1():
    return 1


def f2():
    return 2


def f3():
    return 3


def f4():
    return t._debug_chain()


def main():
    out = {"initial": t.is_active()}
    t.activate()
    t.activate()  # idempotent
    f1()
    out["after_activate"] = [t.is_active(), t.mode(), t.stub_address(f1.__code__) is not None]
    t.deactivate()
    f2()
    out["after_deactivate"] = [t.is_active(), t.mode(), t.stub_address(f2.__code__) is None,
                               t.stub_address(f1.__code__) is not None]
    t.activate()
    f2()
    out["reactivated"] = [t.is_active(), t.stub_address(f2.__code__) is not None]
    try:
        t.activate("hook-only")
    except t.TrampolineError as exc:
        out["mode_switch_error"] = str(exc)
    t.deactivate()
    t.activate("hook-only")
    f3()
    out["hook_only"] = [t.is_active(), t.mode(), t.stub_address(f3.__code__) is None,
                        f4() == []]
    t.deactivate()
    try:
        t.activate("bogus")
    except ValueError as exc:
        out["bad_mode"] = str(exc)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
