/*
 * The runtime as a plain extension module, without cffi: what `tramprof
 * inject` loads into a running CPython 3.9-3.11 that has neither cffi nor
 * tramprof_trampolines installed. Built from the same tramprof.c, so the
 * descriptor, stubs and perf map are exactly those of ABI.md; installed as
 * tramprof_trampolines/_runtime.so so the profiler finds its descriptor.
 *
 * Module `_runtime`: activate(), deactivate(), is_active(), after_fork_child().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "tramprof.h"

#define ERRLEN 512

static PyObject *
runtime_activate(PyObject *self, PyObject *unused)
{
    char err[ERRLEN] = "";
    if (tramprof_activate(TRAMPROF_MODE_STUBS, 0, err, sizeof err) != 0) {
        PyErr_SetString(PyExc_RuntimeError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
runtime_deactivate(PyObject *self, PyObject *unused)
{
    char err[ERRLEN] = "";
    if (tramprof_deactivate(err, sizeof err) != 0) {
        PyErr_SetString(PyExc_RuntimeError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
runtime_is_active(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(tramprof_is_active());
}

static PyObject *
runtime_after_fork_child(PyObject *self, PyObject *unused)
{
    char err[ERRLEN] = "";
    if (tramprof_after_fork_child(err, sizeof err) != 0)
        PySys_WriteStderr("tramprof_trampolines: fork child: %s\n", err);
    Py_RETURN_NONE;
}

static PyMethodDef runtime_methods[] = {
    {"activate", runtime_activate, METH_NOARGS, "Install the eval-frame hook (stubs)."},
    {"deactivate", runtime_deactivate, METH_NOARGS, "Restore the default evaluator."},
    {"is_active", runtime_is_active, METH_NOARGS, "True while the hook is installed."},
    {"after_fork_child", runtime_after_fork_child, METH_NOARGS,
     "Start this process's own perf map (os.register_at_fork)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef runtime_module = {
    PyModuleDef_HEAD_INIT, "_runtime",
    "tramprof trampoline runtime, loaded by tramprof inject (see ABI.md).",
    -1, runtime_methods,
};

PyMODINIT_FUNC
PyInit__runtime(void)
{
    return PyModule_Create(&runtime_module);
}
