"""Installs a foreign PEP 523 eval-frame function (from the shared object
given as argv[1]) and checks that activate() refuses and leaves it alone."""

import ctypes
import json
import sys

import tramprof_trampolines as t

api = ctypes.pythonapi
api.PyInterpreterState_Get.restype = ctypes.c_void_p
api._PyInterpreterState_GetEvalFrameFunc.restype = ctypes.c_void_p
api._PyInterpreterState_GetEvalFrameFunc.argtypes = [ctypes.c_void_p]
api._PyInterpreterState_SetEvalFrameFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
interp = api.PyInterpreterState_Get()

other = ctypes.CDLL(sys.argv[1])
foreign = ctypes.cast(other.foreign_eval, ctypes.c_void_p).value
api._PyInterpreterState_SetEvalFrameFunc(interp, foreign)


def work():
    return sum(i for i in range(100))


out = {}
work()
out["foreign_calls_before"] = ctypes.c_long.in_dll(other, "foreign_calls").value > 0
try:
    t.activate()
    out["error"] = None
except t.TrampolineError as exc:
    out["error"] = str(exc)
out["still_foreign"] = api._PyInterpreterState_GetEvalFrameFunc(interp) == foreign
out["is_active"] = t.is_active()
out["work_stub"] = t.stub_address(work.__code__)
api._PyInterpreterState_SetEvalFrameFunc(
    interp, ctypes.cast(api._PyEval_EvalFrameDefault, ctypes.c_void_p).value)
print(json.dumps(out))
