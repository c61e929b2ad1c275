/* A foreign PEP 523 evaluator (stands in for a debugger or JIT). */
extern void *_PyEval_EvalFrameDefault(void *tstate, void *frame, int throwflag);
long foreign_calls;

void *
foreign_eval(void *tstate, void *frame, int throwflag)
{
    foreign_calls++;
    return _PyEval_EvalFrameDefault(tstate, frame, throwflag);
}
