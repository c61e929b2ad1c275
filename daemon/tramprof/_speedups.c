/*
 * The per-frame passes of naming a drained stack (merging trampoline frames,
 * the cache lookups, names other processes found), the three as one pass
 * over a whole stack, the parse of a process's maps, and the ordered
 * accesses of a perf ring's control page (at the bottom), in C.
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
merged_list(PyObject *ips, PyObject *sps, PyObject *tramps, PyObject *starts, PyObject *ends,
            int incomplete, PyObject *gap)
{
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

static PyObject *
merge_trampolines(PyObject *self, PyObject *args)
{
    PyObject *ips, *sps, *tramps, *starts, *ends, *gap;
    int incomplete;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!pU", &PyTuple_Type, &ips, &PyTuple_Type, &sps,
                          &PyTuple_Type, &tramps, &PyList_Type, &starts, &PyList_Type, &ends,
                          &incomplete, &gap))
        return NULL;
    return merged_list(ips, sps, tramps, starts, ends, incomplete, gap);
}

/* The cache passes over addresses (ints and strs only: their lookups run
 * no Python code): a new list of each one's answer in found, else in
 * jit_found (counted in *jit_hits), else None; *first_miss is the first
 * None's index (-1: none) and *misses counts the ints among them. NULL with
 * an exception set on failure. */
static PyObject *
answers_in(PyObject *addresses, PyObject *found, PyObject *jit_found, Py_ssize_t *jit_hits,
           Py_ssize_t *first_miss, Py_ssize_t *misses)
{
    Py_ssize_t n = PyList_GET_SIZE(addresses);
    *jit_hits = *misses = 0;
    *first_miss = -1;
    PyObject *answers = PyList_New(n);
    if (answers == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *addr = PyList_GET_ITEM(addresses, i);
        PyObject *answer = PyDict_GetItemWithError(found, addr);
        if (answer == NULL && !PyErr_Occurred()) {
            answer = PyDict_GetItemWithError(jit_found, addr);
            if (answer != NULL)
                (*jit_hits)++;
        }
        if (answer == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(answers);
                return NULL;
            }
            answer = Py_None;
            if (*first_miss < 0)
                *first_miss = i;
            *misses += !PyUnicode_CheckExact(addr);
        }
        PyList_SET_ITEM(answers, i, Py_NewRef(answer));
    }
    return answers;
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
    Py_ssize_t n = PyList_GET_SIZE(addresses), first_miss, jit_hits, misses;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *addr = PyList_GET_ITEM(addresses, i);
        if (!PyLong_CheckExact(addr) && !PyUnicode_CheckExact(addr))
            Py_RETURN_NONE;
    }
    PyObject *answers = answers_in(addresses, found, jit_found, &jit_hits, &first_miss, &misses);
    if (answers == NULL)
        return NULL;
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

/*
 * mapping_starts(sources) -> set[int] | None
 *
 * The start addresses of the mappings a named stack's places lie in: each
 * place is None or a tuple whose item 1 is None or a mapping tuple whose
 * item 1 is its start (FrameSource, MappedFile). The unwind tables look at
 * every drained stack's objects, and the stack's frames mostly lie in a few
 * mappings one after another (one set insertion for each run of them). None
 * when sources is not a tuple or list, or an item is not of those kinds:
 * Python then works it out, and says what is wrong.
 */
static PyObject *
mapping_starts(PyObject *self, PyObject *sources)
{
    if (!PyTuple_Check(sources) && !PyList_Check(sources))
        Py_RETURN_NONE;
    PyObject *starts = PySet_New(NULL);
    if (starts == NULL)
        return NULL;
    PyObject *last = NULL;  /* the mapping whose start was added last (borrowed) */
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(sources); i++) {
        PyObject *source = PySequence_Fast_GET_ITEM(sources, i);
        if (source == Py_None)
            continue;
        if (!PyTuple_Check(source) || PyTuple_GET_SIZE(source) < 2)
            goto odd;
        PyObject *mapping = PyTuple_GET_ITEM(source, 1);
        if (mapping == Py_None || mapping == last)
            continue;
        if (!PyTuple_Check(mapping) || PyTuple_GET_SIZE(mapping) < 2 ||
                !PyLong_CheckExact(PyTuple_GET_ITEM(mapping, 1)))
            goto odd;
        if (PySet_Add(starts, PyTuple_GET_ITEM(mapping, 1)) < 0) {
            Py_DECREF(starts);
            return NULL;
        }
        last = mapping;  /* held by the sources, which the caller holds */
    }
    return starts;
odd:
    Py_DECREF(starts);
    Py_RETURN_NONE;
}

/*
 * parse_maps(data, mapping_type) -> [mapping_type(...), ...] | None
 *
 * The lines of a /proc/PID/maps text, in file order, as instances of the
 * tuple subclass mapping_type (start, end, perms, offset, dev_major,
 * dev_minor, inode, path): a new process's maps are parsed at its first
 * sample, and in Python the parse took longer than the kernel's read.
 * Exactly the lines tramprof.procfs.maps._KERNEL_LINE matches, converted as
 * parse_maps converts them; None as soon as any line is not one, a number
 * does not fit in 64 bits, the permissions are not ASCII or a range ends
 * before it starts: the caller then parses in Python, which says what is
 * wrong.
 */

/* Lowercase hex digits at *p up to the first other byte: 1 and the value,
 * 0 when there are none or the value overflows 64 bits. */
static int
scan_hex(const char **p, const char *end, uint64_t *out)
{
    const char *s = *p;
    uint64_t v = 0;
    while (s < end) {
        unsigned d;
        if (*s >= '0' && *s <= '9')
            d = (unsigned)(*s - '0');
        else if (*s >= 'a' && *s <= 'f')
            d = (unsigned)(*s - 'a' + 10);
        else
            break;
        if (v >> 60)
            return 0;
        v = (v << 4) | d;
        s++;
    }
    if (s == *p)
        return 0;
    *p = s;
    *out = v;
    return 1;
}

static int
scan_decimal(const char **p, const char *end, uint64_t *out)
{
    const char *s = *p;
    uint64_t v = 0;
    while (s < end && *s >= '0' && *s <= '9') {
        unsigned d = (unsigned)(*s - '0');
        if (v > (UINT64_MAX - d) / 10)
            return 0;
        v = v * 10 + d;
        s++;
    }
    if (s == *p)
        return 0;
    *p = s;
    *out = v;
    return 1;
}

static int
expect(const char **p, const char *end, char c)
{
    if (*p < end && **p == c) {
        (*p)++;
        return 1;
    }
    return 0;
}

/* Python's bytes-pattern \s: space, \t, \n, \r, \f, \v. */
static int
is_regex_space(char c)
{
    return c == ' ' || (c >= '\t' && c <= '\r');
}

/* The previous line's text of a column and its str: consecutive lines
 * mostly share their permissions and their file (a library's four or five
 * mappings), which then share one str. */
typedef struct {
    const char *text;
    Py_ssize_t len;
    PyObject *str;
} last_text;

static PyObject *
text_str(last_text *last, const char *text, Py_ssize_t len, int ascii)
{
    if (last->str == NULL || last->len != len || memcmp(last->text, text, (size_t)len) != 0) {
        PyObject *str = ascii ? PyUnicode_DecodeASCII(text, len, "strict")
                              : PyUnicode_DecodeUTF8(text, len, "surrogateescape");
        if (str == NULL)
            return NULL;
        Py_XSETREF(last->str, str);
        last->text = text;
        last->len = len;
    }
    return Py_NewRef(last->str);
}

/* One line (no '\n' in [s, end)) as a mapping_type instance; NULL with no
 * error set when it is not a kernel line. */
static PyObject *
parse_maps_line(PyObject *mapping_type, const char *s, const char *end,
                last_text *last_perms, last_text *last_path)
{
    uint64_t start, stop, offset, major, minor, inode;
    if (!scan_hex(&s, end, &start) || !expect(&s, end, '-') || !scan_hex(&s, end, &stop)
            || !expect(&s, end, ' '))
        return NULL;
    const char *perms = s;
    while (s < end && !is_regex_space(*s)) {
        if ((unsigned char)*s >= 0x80)
            return NULL;
        s++;
    }
    Py_ssize_t perms_len = s - perms;
    if (perms_len == 0 || !expect(&s, end, ' ') || !scan_hex(&s, end, &offset)
            || !expect(&s, end, ' ') || !scan_hex(&s, end, &major) || !expect(&s, end, ':')
            || !scan_hex(&s, end, &minor) || !expect(&s, end, ' ')
            || !scan_decimal(&s, end, &inode))
        return NULL;
    if (s < end && *s != ' ')
        return NULL;
    while (s < end && *s == ' ')
        s++;
    if (stop < start)
        return NULL;
    PyObject *row = PyTuple_New(8);
    if (row == NULL)
        return NULL;
    PyObject *items[8] = {
        PyLong_FromUnsignedLong((unsigned long)start),
        PyLong_FromUnsignedLong((unsigned long)stop),
        text_str(last_perms, perms, perms_len, 1),
        PyLong_FromUnsignedLong((unsigned long)offset),
        PyLong_FromUnsignedLong((unsigned long)major),
        PyLong_FromUnsignedLong((unsigned long)minor),
        PyLong_FromUnsignedLong((unsigned long)inode),
        text_str(last_path, s, end - s, 0),
    };
    int failed = 0;
    for (int i = 0; i < 8; i++) {
        failed |= items[i] == NULL;
        PyTuple_SET_ITEM(row, i, items[i]);  /* a NULL item is fine for Py_DECREF(row) */
    }
    if (failed) {
        Py_DECREF(row);
        return NULL;
    }
    PyObject *args = PyTuple_Pack(1, row);
    Py_DECREF(row);
    if (args == NULL)
        return NULL;
    /* tuple.__new__(mapping_type, row), as the named tuple's own __new__. */
    PyObject *mapping = PyTuple_Type.tp_new((PyTypeObject *)mapping_type, args, NULL);
    Py_DECREF(args);
    return mapping;
}

static PyObject *
parse_maps(PyObject *self, PyObject *args)
{
    const char *data;
    Py_ssize_t size;
    PyObject *mapping_type;
    if (!PyArg_ParseTuple(args, "y#O:parse_maps", &data, &size, &mapping_type))
        return NULL;
    if (!PyType_Check(mapping_type)
            || !PyType_IsSubtype((PyTypeObject *)mapping_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "parse_maps: mapping_type must be a tuple subclass");
        return NULL;
    }
    PyObject *mappings = PyList_New(0);
    if (mappings == NULL)
        return NULL;
    last_text last_perms = {0}, last_path = {0};
    const char *s = data, *end = data + size;
    while (s < end) {
        const char *eol = memchr(s, '\n', (size_t)(end - s));
        const char *line_end = eol != NULL ? eol : end;
        PyObject *mapping = parse_maps_line(mapping_type, s, line_end, &last_perms, &last_path);
        if (mapping == NULL || PyList_Append(mappings, mapping) < 0) {
            Py_XDECREF(mapping);
            Py_CLEAR(mappings);
            break;
        }
        Py_DECREF(mapping);
        s = line_end + 1;
    }
    Py_XDECREF(last_perms.str);
    Py_XDECREF(last_path.str);
    if (mappings == NULL && !PyErr_Occurred())
        Py_RETURN_NONE;  /* not a kernel line */
    return mappings;
}

/*
 * shared_answers(addresses, answers, los, his, entries, names, found, max_found,
 *                frame_source) -> int | None
 *
 * Fills in place the misses of cached_answers that other processes' names
 * answer: an address in [los[j], his[j]) (sorted, disjoint: the executable
 * segments of file mappings this process looked up in before), whose
 * entries[j] = (key, bias, mapped) gives the place names[(key, address +
 * bias)] of the name found there by any process. The answer is (name,
 * frame_source(address, mapped)), as ProcessImage._look_up gives it, and it
 * is cached in found while found holds fewer than max_found (the rest stay
 * misses: Python then empties the full cache as it does). Returns how many
 * it answered; None, answering none, when any argument is not of the
 * expected kinds (Python then looks them all up: its lookups are the
 * reference).
 */
/* shared_answers' pass: how many it answered, -1 with an exception set,
 * -2 (answering none) when an argument is not of the expected kinds. */
static Py_ssize_t
fill_shared(PyObject *addresses, PyObject *answers, PyObject *los, PyObject *his,
            PyObject *entries, PyObject *names, PyObject *found, Py_ssize_t max_found,
            PyObject *frame_source)
{
    Py_ssize_t n = PyList_GET_SIZE(addresses), ranges = PyList_GET_SIZE(los);
    if (PyList_GET_SIZE(answers) != n || PyList_GET_SIZE(his) != ranges ||
            PyList_GET_SIZE(entries) != ranges || !PyCallable_Check(frame_source))
        return -2;
    for (Py_ssize_t j = 0; j < ranges; j++) {
        PyObject *entry = PyList_GET_ITEM(entries, j);
        uint64_t bound;
        if (as_u64(PyList_GET_ITEM(los, j), &bound) < 0 ||
                as_u64(PyList_GET_ITEM(his, j), &bound) < 0 ||
                !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3 ||
                !PyUnicode_CheckExact(PyTuple_GET_ITEM(entry, 0)) ||
                !PyLong_CheckExact(PyTuple_GET_ITEM(entry, 1)))
            return -2;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *addr = PyList_GET_ITEM(addresses, i);
        if (!PyLong_CheckExact(addr) && !PyUnicode_CheckExact(addr))
            return -2;
    }
    Py_ssize_t answered = 0;
    for (Py_ssize_t i = 0; i < n && PyDict_GET_SIZE(found) < max_found; i++) {
        if (PyList_GET_SIZE(addresses) != n || PyList_GET_SIZE(answers) != n ||
                PyList_GET_SIZE(los) != ranges || PyList_GET_SIZE(his) != ranges ||
                PyList_GET_SIZE(entries) != ranges)
            return -2;  /* changed under a call below: Python looks up the rest */
        PyObject *addr = PyList_GET_ITEM(addresses, i);
        uint64_t at;
        if (PyList_GET_ITEM(answers, i) != Py_None || as_u64(addr, &at) < 0)
            continue;  /* answered, a marker, or not an address */
        Py_ssize_t lo = 0, hi = ranges;
        while (lo < hi) {  /* bisect_right over los */
            Py_ssize_t mid = (lo + hi) / 2;
            uint64_t start;
            if (as_u64(PyList_GET_ITEM(los, mid), &start) < 0)
                return -2;
            if (at < start)
                hi = mid;
            else
                lo = mid + 1;
        }
        uint64_t end;
        if (lo == 0)
            continue;
        if (as_u64(PyList_GET_ITEM(his, lo - 1), &end) < 0)
            return -2;
        if (at >= end)
            continue;
        PyObject *entry = PyList_GET_ITEM(entries, lo - 1);
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3)
            return -2;
        PyObject *vaddr = PyNumber_Add(addr, PyTuple_GET_ITEM(entry, 1));
        if (vaddr == NULL)
            return -1;
        PyObject *place = PyTuple_Pack(2, PyTuple_GET_ITEM(entry, 0), vaddr);
        Py_DECREF(vaddr);
        if (place == NULL)
            return -1;
        PyObject *name = PyDict_GetItemWithError(names, place);  /* borrowed */
        Py_DECREF(place);
        if (name == NULL) {
            if (PyErr_Occurred())
                return -1;
            continue;
        }
        if (!PyUnicode_CheckExact(name))
            continue;
        /* The call below runs Python code (a NamedTuple's __new__): what is
         * borrowed from the lists is held through it. */
        Py_INCREF(name);
        Py_INCREF(addr);
        Py_INCREF(entry);
        PyObject *source = PyObject_CallFunctionObjArgs(frame_source, addr,
                                                        PyTuple_GET_ITEM(entry, 2), NULL);
        PyObject *answer = source == NULL ? NULL : PyTuple_Pack(2, name, source);
        Py_XDECREF(source);
        Py_DECREF(name);
        Py_DECREF(entry);
        int failed = answer == NULL || PyDict_SetItem(found, addr, answer) < 0;
        Py_DECREF(addr);
        if (failed) {
            Py_XDECREF(answer);
            return -1;
        }
        if (PyList_SetItem(answers, i, answer) < 0)  /* steals answer, drops the None */
            return -1;
        answered++;
    }
    return answered;
}

static PyObject *
shared_answers(PyObject *self, PyObject *args)
{
    PyObject *addresses, *answers, *los, *his, *entries, *names, *found, *frame_source;
    Py_ssize_t max_found;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!nO", &PyList_Type, &addresses,
                          &PyList_Type, &answers, &PyList_Type, &los, &PyList_Type, &his,
                          &PyList_Type, &entries, &PyDict_Type, &names, &PyDict_Type, &found,
                          &max_found, &frame_source))
        return NULL;
    Py_ssize_t answered = fill_shared(addresses, answers, los, his, entries, names, found,
                                      max_found, frame_source);
    if (answered == -1)
        return NULL;
    if (answered == -2)
        Py_RETURN_NONE;
    return PyLong_FromSsize_t(answered);
}

/*
 * cached_stack(ips, sps, tramps, starts, ends, incomplete, stop_gap, gap,
 *              found, jit_found, shared, head, tail_names, tail_sources)
 *     -> (frames, sources, jit_hits, shared_hits) | merged | None
 *
 * A whole sample's frames, root first, when its image's caches, or the
 * names other processes found, name every user frame: ``named_frames``
 * with ``ProcessImage.name_frames_cached`` in one call, for the stacks a
 * busy node drains by the thousand. The user frames are
 * ``merge_trampolines``'s lookup addresses (``stop_gap``: gap appended at
 * the root, as for a table walk's stop without trampoline frames), each
 * named as ``cached_answers`` names it (jit_hits: by the JIT cache; a
 * marker, a str, names itself with no place) and, for the misses,
 * ``shared_answers`` with the arguments in ``shared`` (los, his, entries,
 * names, max_found, frame_source; None: none), which caches what it
 * answers (shared_hits). They go in reverse, between ``head`` (markers)
 * and the kernel part (``tail_names``, ``tail_sources``), in tuples. When
 * an address is left unnamed: the merged list, for the caller to name (it
 * finds what this call cached). None where ``merge_trampolines`` gives
 * None, ``shared`` is not as expected or an answer is not a pair: the
 * caller names the sample as if this call had not been made (what it
 * cached is what the caller's own passes cache).
 */
static PyObject *
cached_stack(PyObject *self, PyObject *args)
{
    PyObject *ips, *sps, *tramps, *starts, *ends, *gap, *found, *jit_found, *shared, *head;
    PyObject *tail_names, *tail_sources;
    PyObject *los = NULL, *his = NULL, *entries = NULL, *names = NULL, *frame_source = NULL;
    Py_ssize_t max_found = 0;
    int incomplete, stop_gap;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!ppUO!O!OO!O!O!", &PyTuple_Type, &ips,
                          &PyTuple_Type, &sps, &PyTuple_Type, &tramps, &PyList_Type, &starts,
                          &PyList_Type, &ends, &incomplete, &stop_gap, &gap, &PyDict_Type,
                          &found, &PyDict_Type, &jit_found, &shared, &PyTuple_Type, &head,
                          &PyTuple_Type, &tail_names, &PyTuple_Type, &tail_sources))
        return NULL;
    Py_ssize_t n_tail = PyTuple_GET_SIZE(tail_names);
    if (PyTuple_GET_SIZE(tail_sources) != n_tail || !PyUnicode_CheckExact(gap))
        Py_RETURN_NONE;
    if (shared != Py_None &&
        (!PyTuple_CheckExact(shared) ||
         !PyArg_ParseTuple(shared, "O!O!O!O!nO", &PyList_Type, &los, &PyList_Type, &his,
                           &PyList_Type, &entries, &PyDict_Type, &names, &max_found,
                           &frame_source))) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *merged = merged_list(ips, sps, tramps, starts, ends, incomplete, gap);
    if (merged == NULL || merged == Py_None)
        return merged;
    if (stop_gap && PyList_Append(merged, gap) < 0) {
        Py_DECREF(merged);
        return NULL;
    }
    /* The merged list holds ints and the gap only: their hashes and
     * comparisons run no Python code. */
    Py_ssize_t n = PyList_GET_SIZE(merged), jit_hits, first_miss, misses, shared_hits = 0;
    PyObject *frames = NULL, *sources = NULL, *result = NULL;
    PyObject *answers = answers_in(merged, found, jit_found, &jit_hits, &first_miss, &misses);
    if (answers == NULL)
        goto done;
    if (misses && los != NULL) {
        shared_hits = fill_shared(merged, answers, los, his, entries, names, found, max_found,
                                  frame_source);
        if (shared_hits == -1)
            goto done;
        if (shared_hits == -2)
            shared_hits = 0;  /* the caller's shared pass says so */
        misses -= shared_hits;
    }
    if (misses) {
        result = Py_NewRef(merged);  /* named by the caller */
        goto done;
    }
    Py_ssize_t n_head = PyTuple_GET_SIZE(head), total = n_head + n + n_tail;
    frames = PyTuple_New(total);
    sources = PyTuple_New(total);
    if (frames == NULL || sources == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n_head; i++) {
        PyTuple_SET_ITEM(frames, i, Py_NewRef(PyTuple_GET_ITEM(head, i)));
        PyTuple_SET_ITEM(sources, i, Py_NewRef(Py_None));
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *answer = PyList_GET_ITEM(answers, i), *name, *source;
        if (answer == Py_None) {  /* a marker (the misses are all answered) */
            name = PyList_GET_ITEM(merged, i);
            source = Py_None;
        } else if (PyTuple_CheckExact(answer) && PyTuple_GET_SIZE(answer) == 2) {
            name = PyTuple_GET_ITEM(answer, 0);
            source = PyTuple_GET_ITEM(answer, 1);
        } else {
            goto fallback;
        }
        Py_ssize_t at = n_head + n - 1 - i;  /* root first */
        PyTuple_SET_ITEM(frames, at, Py_NewRef(name));
        PyTuple_SET_ITEM(sources, at, Py_NewRef(source));
    }
    for (Py_ssize_t i = 0; i < n_tail; i++) {
        PyTuple_SET_ITEM(frames, n_head + n + i, Py_NewRef(PyTuple_GET_ITEM(tail_names, i)));
        PyTuple_SET_ITEM(sources, n_head + n + i, Py_NewRef(PyTuple_GET_ITEM(tail_sources, i)));
    }
    result = Py_BuildValue("(NNnn)", frames, sources, jit_hits, shared_hits);
    frames = sources = NULL;  /* stolen */
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(frames);
    Py_XDECREF(sources);
    Py_XDECREF(answers);
    Py_DECREF(merged);
    return result;
}

/*
 * ring_head(ring, offset) -> int, ring_tail(ring, offset, tail)
 *
 * A perf ring's data_head, read with acquire order (no record after it is
 * read before it), and its data_tail, stored with release order (every
 * record before it is read first): include/uapi/linux/perf_event.h asks a
 * reader for these barriers (tramprof.sampler.perfring). ``ring`` is the
 * writable mapping of the ring, its control page first; ``offset`` is where
 * the control page keeps the word (perfring's DATA_HEAD, DATA_TAIL). Unlike
 * the passes above, they raise (ValueError) for anything else: the Python
 * they stand for is the same access without the barriers.
 */
static uint64_t *
ring_word(Py_buffer *view, Py_ssize_t offset)
{
    if (offset < 0 || view->len < offset + 8 || ((uintptr_t)view->buf + offset) % 8) {
        PyErr_SetString(PyExc_ValueError, "not a perf ring's mapping");
        return NULL;
    }
    return (uint64_t *)((char *)view->buf + offset);
}

static PyObject *
ring_head(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t offset;
    if (!PyArg_ParseTuple(args, "w*n:ring_head", &view, &offset))
        return NULL;
    uint64_t *word = ring_word(&view, offset);
    PyObject *head = word == NULL ? NULL
        : PyLong_FromUnsignedLongLong(__atomic_load_n(word, __ATOMIC_ACQUIRE));
    PyBuffer_Release(&view);
    return head;
}

static PyObject *
ring_tail(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t offset;
    unsigned long long tail;
    if (!PyArg_ParseTuple(args, "w*nK:ring_tail", &view, &offset, &tail))
        return NULL;
    uint64_t *word = ring_word(&view, offset);
    if (word != NULL)
        __atomic_store_n(word, (uint64_t)tail, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    if (word == NULL)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"merge_trampolines", merge_trampolines, METH_VARARGS,
     "A sample's lookup addresses with its trampoline frames merged in (None: not the "
     "ordinary case)."},
    {"cached_answers", cached_answers, METH_VARARGS,
     "Each address's cached answer, the JIT cache's hits, the first miss."},
    {"shared_answers", shared_answers, METH_VARARGS,
     "Fills the misses that names found by other processes answer; how many (None: odd "
     "arguments)."},
    {"cached_stack", cached_stack, METH_VARARGS,
     "A sample's frames and places, root first, from its image's caches (the merged "
     "addresses when one misses; None: not the ordinary case)."},
    {"split_pairs", split_pairs, METH_O,
     "A list of pairs as the list of their firsts and the list of their seconds."},
    {"mapping_starts", mapping_starts, METH_O,
     "The start addresses of the mappings of a stack's places (None: not all places)."},
    {"parse_maps", parse_maps, METH_VARARGS,
     "The lines of a maps text as mappings, in file order (None: not all kernel lines)."},
    {"ring_head", ring_head, METH_VARARGS,
     "A perf ring's data_head, read with acquire order."},
    {"ring_tail", ring_tail, METH_VARARGS,
     "Stores a perf ring's data_tail with release order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tramprof._speedups",
    .m_doc = "The per-frame passes of naming a stack, the maps parse and a perf ring's "
              "ordered accesses, in C (Python's code is the reference).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModule_Create(&module);
}
