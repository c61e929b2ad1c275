/*
 * The two per-frame passes of naming a drained stack, in C.
 *
 * A busy node drains ~1,000 distinct stacks of up to ~160 frames every
 * interval. In Python, merging a stack's trampoline frames into its native
 * frames and looking its addresses up in the per-process caches cost ~45 us
 * a stack; here they cost a few. Each function takes the ordinary case only
 * and returns None for anything else (an odd value from a process that lies
 * about its stack, a type it does not expect): the caller then runs the
 * Python code these functions stand for, which stays the definition of the
 * result (tramprof.unwind.merge, tramprof.symbols.images). Tests compare the
 * two on random stacks.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* An address as a u64; 0 and -1 (with no Python error left) when it is not
 * a non-negative int below 2**64. */
_Static_assert(sizeof(unsigned long) == sizeof(uint64_t), "a u64 is an unsigned long");

static int
as_u64(PyObject *value, uint64_t *out)
{
    if (!PyLong_CheckExact(value))
        return -1;
    /* Not ...LongLong: for ints above 2**30 it goes through a byte array. */
    unsigned long v = PyLong_AsUnsignedLong(value);
    if (v == (unsigned long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

/* Arenas.__contains__: the last range starting at or below addr holds it.
 * starts and ends are Arenas' own lists (ints, sorted, non-overlapping). */
static int
in_arenas(PyObject *starts, PyObject *ends, uint64_t addr, int *inside)
{
    Py_ssize_t lo = 0, hi = PyList_GET_SIZE(starts);
    while (lo < hi) { /* bisect_right */
        Py_ssize_t mid = (lo + hi) / 2;
        uint64_t start;
        if (as_u64(PyList_GET_ITEM(starts, mid), &start) < 0)
            return -1;
        if (addr < start)
            hi = mid;
        else
            lo = mid + 1;
    }
    if (lo == 0) {
        *inside = 0;
        return 0;
    }
    uint64_t end;
    if (lo - 1 >= PyList_GET_SIZE(ends) || as_u64(PyList_GET_ITEM(ends, lo - 1), &end) < 0)
        return -1;
    *inside = addr < end;
    return 0;
}

typedef struct {
    uint64_t sp;
    PyObject *addr; /* borrowed from the caller's tuples, or owned (pcs) */
} frame_t;

/* More trampoline frames than a drain ever gives (the BPF records hold at
 * most a few hundred) are left to Python: the sort below is quadratic. */
#define MAX_SORTED 1024

/* Stable sort by stack address: insertion sort, as the chain walk and the
 * stack scan give frames in stack order. */
static void
sort_frames(frame_t *frames, Py_ssize_t count)
{
    for (Py_ssize_t i = 1; i < count; i++) {
        frame_t moved = frames[i];
        Py_ssize_t at = i;
        while (at > 0 && frames[at - 1].sp > moved.sp) {
            frames[at] = frames[at - 1];
            at--;
        }
        frames[at] = moved;
    }
}

/*
 * merge_trampolines(ips, sps, trampoline_frames, starts, ends, incomplete, gap)
 *
 * ``merged_user_addresses`` for a sample that is not paused: the native
 * frames' lookup addresses (the leaf's ip, the callers' return addresses
 * minus one), in the walker's order. With trampoline frames ((stub address,
 * stack address) pairs), the native frames in a stub arena (starts, ends:
 * ``Arenas.search_lists``) are dropped, the trampoline frames put in stack
 * order (a stable sort) and each merged in before the first native frame
 * above it (``heapq.merge``: native first on equal stack addresses); when
 * ``incomplete`` and a native frame is left, ``gap`` goes before the first
 * trampoline frame above the last native one. Without trampoline frames the
 * caller passes no arenas. None when a value is not a u64, a caller's
 * return address is 0, or there are more than MAX_SORTED trampoline frames.
 */
static PyObject *
merge_trampolines(PyObject *self, PyObject *args)
{
    PyObject *ips, *sps, *tramps, *starts, *ends, *gap;
    int incomplete;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!pU", &PyTuple_Type, &ips, &PyTuple_Type, &sps,
                          &PyTuple_Type, &tramps, &PyList_Type, &starts, &PyList_Type, &ends,
                          &incomplete, &gap))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(ips), m = PyTuple_GET_SIZE(tramps);
    if (n != PyTuple_GET_SIZE(sps) || PyList_GET_SIZE(starts) != PyList_GET_SIZE(ends) ||
        m > MAX_SORTED)
        Py_RETURN_NONE;
    frame_t *frames = PyMem_Malloc(sizeof(frame_t) * (size_t)(n + m + 1));
    if (frames == NULL)
        return PyErr_NoMemory();
    PyObject *result = NULL;
    Py_ssize_t native = 0, owned = 0, i;
    /* The native frames kept, in frames[0:native]; their pcs are owned. */
    for (i = 0; i < n; i++) {
        uint64_t ip, sp;
        int stub;
        if (as_u64(PyTuple_GET_ITEM(ips, i), &ip) < 0 || as_u64(PyTuple_GET_ITEM(sps, i), &sp) < 0)
            goto fallback;
        if (i > 0) {
            if (ip == 0)
                goto fallback;
            ip -= 1;
        }
        if (in_arenas(starts, ends, ip, &stub) < 0)
            goto fallback;
        if (stub)
            continue;
        PyObject *pc = i == 0 ? Py_NewRef(PyTuple_GET_ITEM(ips, 0))
                              : PyLong_FromUnsignedLong(ip);
        if (pc == NULL)
            goto error;
        frames[native].sp = sp;
        frames[native].addr = pc;
        native++;
        owned = native;
    }
    /* The trampoline frames, in frames[native:native + m]. */
    frame_t *tramp = frames + native;
    for (i = 0; i < m; i++) {
        PyObject *pair = PyTuple_GET_ITEM(tramps, i);
        uint64_t ip, sp;
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            as_u64(PyTuple_GET_ITEM(pair, 0), &ip) < 0 ||
            as_u64(PyTuple_GET_ITEM(pair, 1), &sp) < 0)
            goto fallback;
        tramp[i].sp = sp;
        tramp[i].addr = PyTuple_GET_ITEM(pair, 0);
    }
    sort_frames(tramp, m);
    /* The marker goes before the first trampoline frame above the last
     * native frame (none: no marker). */
    uint64_t reached = native ? frames[native - 1].sp : 0;
    Py_ssize_t gap_at = -1;
    if (incomplete && native > 0)
        for (i = 0; i < m && gap_at < 0; i++)
            if (tramp[i].sp > reached)
                gap_at = i;
    result = PyList_New(native + m + (gap_at >= 0 ? 1 : 0));
    if (result == NULL)
        goto error;
    Py_ssize_t a = 0, b = 0, out = 0;
    while (a < native || b < m) {
        if (b < m && (a >= native || tramp[b].sp < frames[a].sp)) {
            if (b == gap_at)
                PyList_SET_ITEM(result, out++, Py_NewRef(gap));
            PyList_SET_ITEM(result, out++, Py_NewRef(tramp[b++].addr));
        } else {
            PyList_SET_ITEM(result, out++, Py_NewRef(frames[a++].addr));
        }
    }
    goto done;
fallback:
    result = Py_NewRef(Py_None);
    goto done;
error:
    Py_CLEAR(result);
done:
    for (i = 0; i < owned; i++)
        Py_DECREF(frames[i].addr);
    PyMem_Free(frames);
    return result;
}

/*
 * cached_answers(addresses, found, jit_found) -> (answers, jit_hits, first_miss)
 *
 * The cache passes of ``ProcessImage.name_frames_cached``: for each
 * address its answer in ``found``, else in ``jit_found`` (counted in
 * jit_hits), else None; first_miss is the index of the first None (-1: none).
 * None when an address is neither an int nor a str (their lookups run no
 * Python code that could change the list under this loop).
 */
static PyObject *
cached_answers(PyObject *self, PyObject *args)
{
    PyObject *addresses, *found, *jit_found;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyList_Type, &addresses, &PyDict_Type, &found,
                          &PyDict_Type, &jit_found))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(addresses), first_miss = -1, jit_hits = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *addr = PyList_GET_ITEM(addresses, i);
        if (!PyLong_CheckExact(addr) && !PyUnicode_CheckExact(addr))
            Py_RETURN_NONE;
    }
    PyObject *answers = PyList_New(n);
    if (answers == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *addr = PyList_GET_ITEM(addresses, i);
        PyObject *answer = PyDict_GetItemWithError(found, addr);
        if (answer == NULL && !PyErr_Occurred()) {
            answer = PyDict_GetItemWithError(jit_found, addr);
            if (answer != NULL)
                jit_hits++;
        }
        if (answer == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(answers);
                return NULL;
            }
            answer = Py_None;
            if (first_miss < 0)
                first_miss = i;
        }
        PyList_SET_ITEM(answers, i, Py_NewRef(answer));
    }
    return Py_BuildValue("(Nnn)", answers, jit_hits, first_miss);
}

/*
 * split_pairs(pairs) -> (firsts, seconds)
 *
 * A stack's answers, (name, place) each, as a list of names and a list of
 * places (``zip(*pairs)`` builds a 160-argument call for it); None when an
 * item is not a pair.
 */
static PyObject *
split_pairs(PyObject *self, PyObject *pairs)
{
    if (!PyList_Check(pairs)) {
        PyErr_SetString(PyExc_TypeError, "split_pairs: a list of pairs");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(pairs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2)
            Py_RETURN_NONE;
    }
    PyObject *firsts = PyList_New(n), *seconds = PyList_New(n);
    if (firsts == NULL || seconds == NULL) {
        Py_XDECREF(firsts);
        Py_XDECREF(seconds);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        PyList_SET_ITEM(firsts, i, Py_NewRef(PyTuple_GET_ITEM(pair, 0)));
        PyList_SET_ITEM(seconds, i, Py_NewRef(PyTuple_GET_ITEM(pair, 1)));
    }
    return Py_BuildValue("(NN)", firsts, seconds);
}

static PyMethodDef methods[] = {
    {"merge_trampolines", merge_trampolines, METH_VARARGS,
     "A sample's lookup addresses with its trampoline frames merged in (None: not the "
     "ordinary case)."},
    {"cached_answers", cached_answers, METH_VARARGS,
     "Each address's cached answer, the JIT cache's hits, the first miss."},
    {"split_pairs", split_pairs, METH_O,
     "A list of pairs as the list of their firsts and the list of their seconds."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tramprof._speedups",
    .m_doc = "The per-frame passes of naming a stack, in C (Python's code is the reference).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModule_Create(&module);
}
