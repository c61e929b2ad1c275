"""The Python code that runs inside the target and turns trampolines on (or off).

It runs on a thread that holds the GIL, at a point where the interpreter
expects to run code (a pending call, or PEP 768's safe point), and must
never raise: an exception escaping a pending call would surface in whatever
the main thread was doing. It binds no names where it runs (a fresh
namespace through ``exec``), and reports one line to a result file the
injector made for it:

``ok chain|perf`` activated; ``ok chain off|perf off`` deactivated;
``already_active chain|perf``; ``not_active``; ``failed: <why>``.

Preference (chain mode is exact and cheaper to unwind than scan mode):
``tramprof_trampolines`` when it is installed in the target, then the
prebuilt runtime the injector placed (3.9-3.11), then CPython's own
``sys.activate_stack_trampoline("perf")`` (3.12+).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

#: Module name under which an injected runtime is kept (for ``--off``).
INJECTED_MODULE = "_tramprof_trampolines_injected"

#: The activation's claim in ``sys.__dict__``: the key ends with a token of
#: its own, so each attempt is claimed once.
CLAIM_PREFIX = "_tramprof_inject_"

_SOURCE = r'''
def _tramprof_inject(result_path, runtime_path, off, token):
    import os
    import sys

    # Several threads may be asked at once (PEP 768): one claim wins, the
    # others return at once (dict.setdefault is atomic under the GIL).
    key = CLAIM_PREFIX + token
    claim = object()
    if sys.__dict__.setdefault(key, claim) is not claim:
        return
    reported = []

    def report(text):
        try:
            fd = os.open(result_path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.write(fd, (text + "\n").encode("utf-8", "replace")[:2000])
                reported.append(text)
            finally:
                os.close(fd)
        except Exception:
            pass

    try:
        for name in ("_interpreters", "_xxsubinterpreters"):
            try:
                current = __import__(name).get_current()
            except Exception:
                continue
            if isinstance(current, tuple):
                current = current[0]
            if int(current) != 0:
                report("failed: ran in a sub-interpreter")
                return
            break
        perf_active = getattr(sys, "is_stack_trampoline_active", None)
        ours = sys.modules.get(INJECTED) or sys.modules.get("tramprof_trampolines")
        if off:
            if ours is not None and ours.is_active():
                ours.deactivate()
                report("ok chain off")
            elif perf_active is not None and perf_active():
                sys.deactivate_stack_trampoline()
                report("ok perf off")
            else:
                report("not_active")
            return
        if perf_active is not None and perf_active():
            report("already_active perf")
            return
        if ours is not None and ours.is_active():
            report("already_active chain")
            return
        import importlib.util
        if ours is None and importlib.util.find_spec("tramprof_trampolines") is not None:
            try:
                import tramprof_trampolines
                tramprof_trampolines.activate()
                report("ok chain")
                return
            except Exception:
                pass
        if runtime_path:
            import importlib.machinery
            loader = importlib.machinery.ExtensionFileLoader("_runtime", runtime_path)
            spec = importlib.util.spec_from_file_location("_runtime", runtime_path,
                                                          loader=loader)
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            module.activate()
            sys.modules[INJECTED] = module
            os.register_at_fork(after_in_child=module.after_fork_child)
            report("ok chain")
            return
        if hasattr(sys, "activate_stack_trampoline"):
            sys.activate_stack_trampoline("perf")
            report("ok perf")
            return
        report("failed: no trampolines for this interpreter (no runtime, no -X perf support)")
    except BaseException as exc:
        report("failed: %s: %s" % (type(exc).__name__, exc))
    finally:
        # Nothing reported (even report() needs a frame, which a run a frame
        # short of the recursion limit does not have): the claim goes, so a
        # later run, asked again, starts afresh. C calls only: no frame.
        if not reported and sys.__dict__.get(key) is claim:
            sys.__dict__.pop(key, None)


_tramprof_inject(RESULT, RUNTIME, OFF, TOKEN)
'''


# The statement the target runs; it binds no name where it runs. When the
# activation cannot even start - the interpreter ran it a frame or two short
# of the recursion limit, or out of memory - the error is reported (unless
# another thread claimed the activation; the failing thread claims it with
# its thread id, so no other starts it now) instead of reaching the target's
# code; the injector asks again later, when the target runs elsewhere. If
# even the report fails, the claim is dropped, so a run asked again later
# (PEP 768) can start. Built-in calls only in the handler: each Python call
# needs a frame.
_STATEMENT = """\
try:
    exec(compile(SOURCE, '<tramprof-inject>', 'exec'), {'__name__': '__tramprof_inject__'})
except BaseException:
    try:
        if (__import__('sys').__dict__.setdefault(CLAIM, __import__('_thread').get_ident())
                == __import__('_thread').get_ident()):
            __import__('io').FileIO(__import__('os').open(RESULT, FLAGS), 'w').write(
                ('failed: %s\\n' % __import__('sys').exc_info()[0].__name__).encode())
    except BaseException:
        try:
            if __import__('sys').__dict__.get(CLAIM) == __import__('_thread').get_ident():
                del __import__('sys').__dict__[CLAIM]
        except BaseException:
            pass
"""


def activation_code(result_path: str, runtime_path: str | None, off: bool) -> str:
    """The statement that runs the activation in a namespace of its own."""
    token = secrets.token_hex(8)
    source = (_SOURCE.replace("CLAIM_PREFIX", repr(CLAIM_PREFIX))
              .replace("INJECTED", repr(INJECTED_MODULE))
              .replace("RESULT, RUNTIME, OFF, TOKEN",
                       f"{result_path!r}, {runtime_path!r}, {off!r}, {token!r}"))
    flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    return (_STATEMENT.replace("CLAIM", repr(CLAIM_PREFIX + token))
            .replace("RESULT", repr(result_path)).replace("FLAGS", str(flags))
            .replace("SOURCE", repr(source)))


@dataclass(frozen=True)
class Outcome:
    """What the code in the target reported."""

    status: str       # ok | already_active | not_active | failed
    mode: str = ""    # chain | perf (for ok and already_active)
    detail: str = ""

    @classmethod
    def parse(cls, raw: bytes) -> Outcome | None:
        """None until a complete line is there."""
        if not raw.endswith(b"\n"):
            return None
        line = raw.decode("utf-8", "replace").strip()
        if line.startswith("failed:"):
            return cls("failed", detail=line[len("failed:"):].strip()[:500])
        words = line.split()
        if not words or words[0] not in ("ok", "already_active", "not_active"):
            return cls("failed", detail=f"unexpected report {line[:200]!r}")
        mode = words[1] if len(words) > 1 and words[1] in ("chain", "perf") else ""
        return cls(words[0], mode, " ".join(words[1:]))
