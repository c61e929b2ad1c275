"""CPython 3.9-3.13: schedule one pending call through a short ptrace stop.

One thread is stopped and made to run ``Py_AddPendingCall(run, code)``;
CPython then runs ``code`` on the main thread at its next safe point, with
the GIL, exactly like a signal handler. ``run`` is a five-instruction
function placed with the stub: it calls ``PyRun_SimpleString(code)`` and
returns 0 whatever that returned. A pending call that fails makes the
interrupted Python code fail with it, and ``PyRun_SimpleString`` fails
when ``code`` cannot even start (a frame short of the recursion limit: it
prints the error and returns -1 with none set, a SystemError in the
target's code); the target must never see the activation fail. Nothing is loaded
while the thread is hijacked: no ``dlopen`` (whose loader and malloc locks
the interrupted code may hold), only one ``mmap`` system call and one call
of a function meant to be called from any thread without the GIL. The
runtime library, when one is needed, is loaded later by ``code`` itself,
as an ordinary extension module import on the main thread.

Steps, each with a deadline (``ptrace.StepTimeout``) and followed on every
path by restoring the registers and detaching:

1. seize and interrupt the thread: before 3.13 the main thread, wherever
   it is (only a call made on the main thread wakes the main thread, see
   ``MAIN_THREAD_ONLY_BEFORE``); from 3.13 preferably one blocked in a
   system call, interrupted at a known place like any signal would. A main
   thread interrupted while it holds the pending-call queue's lock (only
   while adding or taking a call) makes the stub wait on that lock: the
   step's deadline passes, its registers are restored and it goes on where
   it was (the injection times out, nothing changed);
2. one ``mmap(PROT_READ|PROT_EXEC)`` of two pages, executed at a
   ``syscall`` instruction (the one the thread was blocked in, else one in
   the vDSO) by single-stepping, registers restored at once;
3. the page gets (through ptrace, as a debugger writes breakpoints) a stub,
   the code string, and a copy of the thread's registers;
4. the thread runs the stub: ``call Py_AddPendingCall``, then ``getpid``
   as a marker the tracer stops at (``PTRACE_SYSCALL``), and finally
   restores every register itself and jumps back to where it was;
5. at the marker the tracer restores the original registers (the kernel
   then restarts an interrupted system call as it would after a signal)
   and detaches.

If the tracer dies in step 4 or 5, the stub's own epilogue puts the thread
back (restarting its system call like the kernel would), so the target keeps
running. The only window where the tracer's death would leave the thread in
a changed state is step 2 (one single-step of ``mmap``, tens of
microseconds). The two pages stay mapped (8 KiB per call queued).
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import time
from dataclasses import dataclass

from tramprof.inject import ptrace
from tramprof.inject.target import Target, main_thread_running, pause_point
from tramprof.procfs.memory import read_memory

PAGE_BYTES = 8192
CODE_AT = 0x000
RUN_AT = 0x1C0     # the pending call's function
DATA_AT = 0x200
STRING_AT = 0x400
MAX_CODE_BYTES = PAGE_BYTES - STRING_AT - 1
SYS_MMAP = 9
SYS_GETPID = 39
SYS_RESTART = 219
PROT_READ_EXEC = 0x5
MAP_PRIVATE_ANON = 0x22
ERESTART = {-512, -513, -514}   # ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND
ERESTART_RESTARTBLOCK = -516
# Data block (at DATA_AT): function pointers, then the registers to resume with.
_D_FUNC, _D_ADD_PENDING = 0, 8
_RESTORE_ORDER = ("r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8",
                  "rax", "rcx", "rdx", "rsi", "rdi", "rsp")
_D_REGS = 16                       # 16 words, in _RESTORE_ORDER
_D_RIP = _D_REGS + 8 * len(_RESTORE_ORDER)
_D_EFLAGS = _D_RIP + 8
# mov reg, [rip+disp32]: REX prefix, opcode 8b, ModRM (reg << 3 | 5)
_REG_CODE = {"rax": 0, "rcx": 1, "rdx": 2, "rbx": 3, "rsp": 4, "rbp": 5, "rsi": 6, "rdi": 7,
             "r8": 8, "r9": 9, "r10": 10, "r11": 11, "r12": 12, "r13": 13, "r14": 14,
             "r15": 15}


class HijackError(RuntimeError):
    """The thread could not be made to schedule the call (registers restored)."""


def _rip_relative(opcode: bytes, here: int, length: int, target: int) -> bytes:
    """``opcode`` followed by disp32 = target - (here + length)."""
    return opcode + struct.pack("<i", target - (here + length))


def assemble_stub() -> bytes:
    """The stub's machine code (position independent: everything it uses is
    addressed relative to itself, in the data block)."""
    code = bytearray()

    def rip_op(opcode: bytes, data_offset: int) -> None:
        here = CODE_AT + len(code)
        code.extend(_rip_relative(opcode, here, len(opcode) + 4, DATA_AT + data_offset))

    def mov_load(reg: str, data_offset: int) -> None:
        number = _REG_CODE[reg]
        rex = 0x48 | (0x04 if number >= 8 else 0)
        rip_op(bytes([rex, 0x8B, ((number & 7) << 3) | 5]), data_offset)

    here = CODE_AT + len(code)                                   # lea rdi, [rip+run]
    code.extend(_rip_relative(b"\x48\x8d\x3d", here, 7, RUN_AT))
    here = CODE_AT + len(code)                                   # lea rsi, [rip+string]
    code.extend(_rip_relative(b"\x48\x8d\x35", here, 7, STRING_AT))
    rip_op(b"\xff\x15", _D_ADD_PENDING)                          # call [Py_AddPendingCall]
    code.extend(b"\x89\xc7")                                     # mov edi, eax (the result)
    code.extend(b"\xb8" + struct.pack("<I", SYS_GETPID))         # mov eax, SYS_getpid
    code.extend(b"\x0f\x05")                                     # syscall: the tracer stops here
    rip_op(b"\xff\x35", _D_EFLAGS)                               # push [eflags]
    code.extend(b"\x9d")                                         # popfq
    for i, reg in enumerate(_RESTORE_ORDER):                     # every register, rsp last
        mov_load(reg, _D_REGS + 8 * i)
    rip_op(b"\xff\x25", _D_RIP)                                  # jmp [rip to resume at]
    if len(code) > RUN_AT - CODE_AT:
        raise AssertionError("stub overlaps the pending call's function")
    return bytes(code)


def assemble_run() -> bytes:
    """``int run(const char *code)``: ``PyRun_SimpleString(code)``, then 0."""
    code = bytearray(b"\x48\x83\xec\x08")                      # sub rsp, 8 (align the call)
    here = RUN_AT + len(code)                                    # call [PyRun_SimpleString]
    code.extend(_rip_relative(b"\xff\x15", here, 6, DATA_AT + _D_FUNC))
    code.extend(b"\x48\x83\xc4\x08")                            # add rsp, 8
    code.extend(b"\x31\xc0")                                     # xor eax, eax
    code.extend(b"\xc3")                                         # ret
    if RUN_AT + len(code) > DATA_AT:
        raise AssertionError("the pending call's function overlaps the data")
    return bytes(code)


def resume_state(regs: ptrace.Regs) -> tuple[ptrace.Regs, int]:
    """Registers (and rip) the stub restores by itself when no tracer is left:
    a system call the stop interrupted is restarted, as the kernel would."""
    out = regs.copy()
    rip = regs.rip
    orig = ptrace.Regs.signed(regs.orig_rax)
    rax = ptrace.Regs.signed(regs.rax)
    if orig >= 0 and rax in ERESTART:
        out.rax, rip = regs.orig_rax, regs.rip - 2
    elif orig >= 0 and rax == ERESTART_RESTARTBLOCK:
        out.rax, rip = SYS_RESTART, regs.rip - 2
    return out, rip


def build_page(regs: ptrace.Regs, run_function: int, add_pending: int, code: bytes) -> bytes:
    if len(code) > MAX_CODE_BYTES or b"\0" in code:
        raise ValueError(f"code for the pending call is {len(code)} bytes "
                         f"(at most {MAX_CODE_BYTES}, no NUL)")
    resume, rip = resume_state(regs)
    page = bytearray(STRING_AT + len(code) + 1)
    stub = assemble_stub()
    page[CODE_AT:CODE_AT + len(stub)] = stub
    run = assemble_run()
    page[RUN_AT:RUN_AT + len(run)] = run
    data = struct.pack("<QQ", run_function, add_pending)
    data += b"".join(struct.pack("<Q", getattr(resume, reg)) for reg in _RESTORE_ORDER)
    data += struct.pack("<QQ", rip, regs.eflags)
    page[DATA_AT:DATA_AT + len(data)] = data
    page[STRING_AT:STRING_AT + len(code)] = code
    return bytes(page)


#: Before 3.13 ``Py_AddPendingCall`` sets the eval breaker only when the
#: main thread itself calls it (CPython computes the breaker for the calling
#: thread). From another thread the call waits until the main thread happens
#: to recompute it (a GIL hand-over, a signal), which a main thread running
#: Python code without ever releasing the GIL does not do: the activation
#: would wait for as long as that lasts.
MAIN_THREAD_ONLY_BEFORE = (3, 13)


def choose_thread(pid: int, version: tuple[int, int]) -> int:
    """The thread to make the call: before 3.13 the main thread, wherever it
    is; from 3.13 a thread blocked in a system call (main thread first), else
    the main thread: interrupting a blocked thread is what a signal does
    every day."""
    if version < MAIN_THREAD_ONLY_BEFORE:
        return pid
    tids = sorted((int(t) for t in os.listdir(f"/proc/{pid}/task")),
                  key=lambda t: (t != pid, t))
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall", "rb") as f:
                first = f.read(64).split(b" ", 1)[0]
        except OSError:
            continue
        if first.lstrip(b"-").isdigit() and int(first) >= 0:
            return tid
    return pid


def _vdso_syscall(pid: int, target: Target) -> int | None:
    for m in target.mappings:
        if m.path == "[vdso]" and m.is_exec:
            image = read_memory(pid, m.start, min(m.size, 1 << 16))
            found = image.find(b"\x0f\x05")
            return m.start + found if found >= 0 else None
    return None


@dataclass(frozen=True)
class Scheduled:
    tid: int                 # the thread that made the call
    stop_seconds: float      # how long it was stopped
    result: int              # Py_AddPendingCall's return value (0: queued)


def schedule_pending_call(target: Target, code: str, step_seconds: float = 0.5) -> Scheduled:
    """Queue ``PyRun_SimpleString(code)`` as a pending call in ``target``."""
    with ptrace.no_gc():
        return _schedule(target, code, step_seconds)


def _schedule(target: Target, code: str, step_seconds: float) -> Scheduled:
    run_function = target.interpreter.symbols["PyRun_SimpleString"]
    add_pending = target.interpreter.symbols["Py_AddPendingCall"]
    encoded = code.encode()
    _check_running(target)
    tid = choose_thread(target.pid, target.version)
    assemble_stub()          # everything that can be done before the stop is done
    ptrace.libc()
    tracee = ptrace.Tracee(tid, target.pid)
    saved: ptrace.Regs | None = None
    try:
        tracee.seize_and_stop(time.monotonic() + step_seconds)
        stopped_at = time.monotonic()
        # Again with a thread held: now its process cannot be reaped, nor its
        # pid given to another, until we let go.
        _check_running(target)
        saved = tracee.getregs()
        pause_point("seized")
        page = _map_page(target, tracee, saved, step_seconds)
        tracee.write(page, build_page(saved, run_function, add_pending, encoded))
        call = saved.copy()
        call.rip = page + CODE_AT
        call.rsp = (saved.rsp - 1024) & ~0xF
        call.orig_rax = (1 << 64) - 1      # not in a system call: nothing to restart
        call.rax = 0
        tracee.setregs(call)
        result = _run_to_marker(tracee, page, time.monotonic() + step_seconds)
        pause_point("marker")
        tracee.setregs(saved)              # at the marker's exit: the kernel restarts
        tracee.detach()                    # an interrupted call, as after a signal
        return Scheduled(tid, time.monotonic() - stopped_at, result)
    except BaseException:
        if tracee.attached:
            with contextlib.suppress(ptrace.PtraceError, ptrace.StepTimeout, ptrace.TraceeGone):
                tracee.ensure_stopped(time.monotonic() + step_seconds)
            if saved is not None:
                with contextlib.suppress(ptrace.PtraceError):
                    tracee.setregs(saved)
            with contextlib.suppress(ptrace.PtraceError):
                tracee.detach()
        raise


def _check_running(target: Target) -> None:
    if not main_thread_running(target):
        raise ptrace.TraceeGone(errno.ESRCH, f"process {target.pid} exited (or its main "
                                "thread did) before the call was queued")


def _map_page(target: Target, tracee: ptrace.Tracee, saved: ptrace.Regs,
              step_seconds: float) -> int:
    """mmap two R+X pages in the target by single-stepping one syscall."""
    gadget = None
    if ptrace.Regs.signed(saved.orig_rax) >= 0:
        word = tracee.peek(saved.rip - 2)
        if word & 0xFFFF == 0x050F:
            gadget = saved.rip - 2
    if gadget is None:
        gadget = _vdso_syscall(target.pid, target)
    if gadget is None:
        raise HijackError("no syscall instruction to run mmap with")
    regs = saved.copy()
    regs.rip, regs.rax, regs.orig_rax = gadget, SYS_MMAP, (1 << 64) - 1
    regs.rdi, regs.rsi, regs.rdx = 0, PAGE_BYTES, PROT_READ_EXEC
    regs.r10, regs.r8, regs.r9 = MAP_PRIVATE_ANON, (1 << 64) - 1, 0
    tracee.setregs(regs)
    try:
        deadline = time.monotonic() + step_seconds
        while True:
            tracee.resume(ptrace.PTRACE_SINGLESTEP)
            tracee.wait(deadline)
            after = tracee.getregs()
            if after.rip == gadget + 2:
                break
    finally:
        tracee.setregs(saved)
    address = ptrace.Regs.signed(after.rax)
    if -4096 < address < 0:
        raise HijackError(f"mmap in the target failed (errno {-address})")
    return address


def _run_to_marker(tracee: ptrace.Tracee, page: int, deadline: float) -> int:
    """Run the stub until it enters getpid (and leaves it): the pending
    call was made; its result is in rdi."""
    entered: int | None = None
    while True:
        tracee.resume(ptrace.PTRACE_SYSCALL)
        status = tracee.wait(deadline)
        if (status >> 8) & 0xFF != ptrace.SYSCALL_TRAP:
            continue            # an interrupt or a (held) signal: carry on
        regs = tracee.getregs()
        in_stub = page <= regs.rip < page + DATA_AT
        if entered is None:
            if in_stub and regs.orig_rax == SYS_GETPID:
                entered = regs.rdi & 0xFFFFFFFF
            continue
        if in_stub and regs.orig_rax == SYS_GETPID:
            return entered - (1 << 32) if entered >= 1 << 31 else entered
