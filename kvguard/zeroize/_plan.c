/* kvguard.zeroize._plan: the planner's per-id passes in C (issue 4, item 2), and the per-call passes
 * of the GPU enqueue (issue 14, item 2: `sample`, `pack`, `call`; see their section below).
 *
 * Pure CPython, one pass over the ids with no Python call per id. In pure Python, `sorted` alone over
 * 10,000 ints took 0.65-1 ms on our hosts (docs/zeroize.md), above the "well under 1 ms" target.
 *
 * Scope is deliberately narrow: only exact `int` ids that fit in 64 bits. For anything else (a bool,
 * a numpy integer, an `__index__` object, a non-integer, an id beyond int64) both functions return
 * None and `kvguard/zeroize/plan.py` runs its pure-Python path, which owns every other rule and every
 * error message. The two paths are held equal by tests/zeroize/test_plan_native.py.
 *
 * Reads every item before allocating any Python object, so no finalizer or other Python code can run
 * (and mutate the input list) while its items are borrowed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(_MSC_VER)
#include <intrin.h>
static inline int lowest_bit(uint64_t word)
{
    unsigned long index;
    _BitScanForward64(&index, word);
    return (int)index;
}
#else
static inline int lowest_bit(uint64_t word) { return __builtin_ctzll(word); }
#endif

/* A bitmap costs one word per 64 ids of span, a sort n log n compares; above this many words per id
 * (plus a fixed allowance) the scan of a sparse bitmap would cost more than sorting the ids. */
#define BITMAP_WORDS_PER_ID 4
#define BITMAP_WORDS_FREE 1024

/* Items of `seq` (a list or tuple) as int64 into `out`. Returns 1 when every item is an exact int
 * that fits, 0 when one is not (the caller falls back to Python), -1 with an exception set. */
static int read_ids(PyObject *seq, long long *out, Py_ssize_t *min_at, Py_ssize_t *max_at)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    *min_at = 0;
    *max_at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item)) { /* bool is a subclass, so it lands here too */
            return 0;
        }
        int overflow = 0;
        long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow != 0) {
            return 0;
        }
        if (value == -1 && PyErr_Occurred()) {
            return -1;
        }
        out[i] = value;
        if (value < out[*min_at]) {
            *min_at = i;
        }
        if (value > out[*max_at]) {
            *max_at = i;
        }
    }
    return 1;
}

/* The ids of `seq` (a list or tuple) in a new PyMem array: 1 with `*out` set (the caller frees it),
 * 0 when an item is not an exact int that fits in 64 bits (the caller falls back to Python), -1 with
 * an exception set. */
static int load_ids(PyObject *seq, long long **out, Py_ssize_t *min_at, Py_ssize_t *max_at)
{
    long long *ids = PyMem_New(long long, (size_t)PySequence_Fast_GET_SIZE(seq));
    if (ids == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int read = read_ids(seq, ids, min_at, max_at);
    if (read <= 0) {
        PyMem_Free(ids);
        return read;
    }
    *out = ids;
    return 1;
}

static int compare_ids(const void *a, const void *b)
{
    long long x = *(const long long *)a;
    long long y = *(const long long *)b;
    return (x > y) - (x < y);
}

/* Sort and deduplicate ids[0..n) in place through a bitmap over [low, low + 64 * words); returns the
 * number of unique ids, or -1 with MemoryError set. */
static Py_ssize_t unique_by_bitmap(long long *ids, Py_ssize_t n, long long low, size_t words)
{
    uint64_t *bitmap = calloc(words, sizeof(uint64_t));
    if (bitmap == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t offset = (uint64_t)(ids[i] - low);
        bitmap[offset >> 6] |= (uint64_t)1 << (offset & 63);
    }
    Py_ssize_t count = 0;
    for (size_t w = 0; w < words; w++) {
        for (uint64_t bits = bitmap[w]; bits != 0; bits &= bits - 1) {
            ids[count++] = low + (long long)(w * 64 + (size_t)lowest_bit(bits));
        }
    }
    free(bitmap);
    return count;
}

static Py_ssize_t unique_by_sort(long long *ids, Py_ssize_t n)
{
    qsort(ids, (size_t)n, sizeof(long long), compare_ids);
    Py_ssize_t count = 1;
    for (Py_ssize_t i = 1; i < n; i++) {
        if (ids[i] != ids[count - 1]) {
            ids[count++] = ids[i];
        }
    }
    return count;
}

static PyObject *ids_to_tuple(const long long *ids, Py_ssize_t count)
{
    PyObject *result = PyTuple_New(count);
    if (result == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *value = PyLong_FromLongLong(ids[i]);
        if (value == NULL) {
            Py_DECREF(result);
            return NULL;
        }
        PyTuple_SET_ITEM(result, i, value);
    }
    return result;
}

/* The sorted, unique ids, or None to fall back; IndexError(id) for the id that is out of range. */
static PyObject *plan_ids(PyObject *seq, long long last)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n == 0) {
        return PyTuple_New(0);
    }
    long long *ids;
    Py_ssize_t min_at, max_at;
    int read = load_ids(seq, &ids, &min_at, &max_at);
    if (read <= 0) {
        return read == 0 ? Py_NewRef(Py_None) : NULL;
    }
    PyObject *result = NULL;
    long long low = ids[min_at], high = ids[max_at];
    /* The smallest negative id, else the largest too large one: the id Python's sorted path names. */
    if (low < 0 || high > last) {
        PyObject *bad = PySequence_Fast_ITEMS(seq)[low < 0 ? min_at : max_at];
        PyErr_SetObject(PyExc_IndexError, bad);
        goto done;
    }
    uint64_t span = (uint64_t)high - (uint64_t)low; /* both in [0, last]: no overflow */
    uint64_t words = (span >> 6) + 1;
    Py_ssize_t count;
    if (words <= (uint64_t)n * BITMAP_WORDS_PER_ID + BITMAP_WORDS_FREE) {
        count = unique_by_bitmap(ids, n, low, (size_t)words);
    }
    else {
        count = unique_by_sort(ids, n);
    }
    if (count >= 0) {
        result = ids_to_tuple(ids, count);
    }
done:
    PyMem_Free(ids);
    return result;
}

PyDoc_STRVAR(unique_sorted_doc,
             "unique_sorted(block_ids, num_blocks, /)\n--\n\n"
             "The sorted, de-duplicated tuple of block_ids (a list or tuple of exact ints in\n"
             "[0, num_blocks)). Returns None when an item is not an exact int or does not fit in\n"
             "64 bits: the caller decides those in Python. Raises IndexError(bad_id) with the\n"
             "smallest negative id, else the largest id >= num_blocks.");

static PyObject *unique_sorted(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "unique_sorted expected 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *block_ids = args[0], *num_blocks = args[1];
    if (!PyList_CheckExact(block_ids) && !PyTuple_CheckExact(block_ids)) {
        PyErr_SetString(PyExc_TypeError, "block_ids must be a list or a tuple");
        return NULL;
    }
    if (!PyLong_Check(num_blocks)) { /* a subclass too: plan_zeroize accepts any int but bool */
        PyErr_SetString(PyExc_TypeError, "num_blocks must be an int");
        return NULL;
    }
    int overflow = 0;
    long long size = PyLong_AsLongLongAndOverflow(num_blocks, &overflow);
    if (size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (overflow < 0 || (overflow == 0 && size <= 0)) {
        PyErr_SetString(PyExc_ValueError, "num_blocks must be positive");
        return NULL;
    }
    /* A cache larger than int64 holds every id that fits in int64. */
    long long last = overflow > 0 ? LLONG_MAX : size - 1;
    return plan_ids(block_ids, last);
}

PyDoc_STRVAR(coalesce_doc,
             "coalesce(block_ids, /)\n--\n\n"
             "Maximal runs (start, length) of consecutive ids in a tuple of exact ints, as\n"
             "plan._coalesce_python computes them; each start is the tuple's own int object.\n"
             "Returns None when an item is not an exact int or does not fit in 64 bits.");

static PyObject *coalesce(PyObject *module, PyObject *block_ids)
{
    (void)module;
    if (!PyTuple_CheckExact(block_ids)) { /* immutable: its items stay valid while we allocate */
        PyErr_SetString(PyExc_TypeError, "block_ids must be a tuple");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(block_ids);
    if (n == 0) {
        return PyTuple_New(0);
    }
    long long *ids;
    Py_ssize_t min_at, max_at;
    int read = load_ids(block_ids, &ids, &min_at, &max_at);
    if (read <= 0) {
        return read == 0 ? Py_NewRef(Py_None) : NULL;
    }
    PyObject *result = NULL;
    /* A run breaks at k when ids[k] - ids[k-1] != 1 (written so that it cannot overflow). */
    Py_ssize_t runs = 1;
    for (Py_ssize_t k = 1; k < n; k++) {
        runs += ids[k - 1] == LLONG_MAX || ids[k] != ids[k - 1] + 1;
    }
    result = PyTuple_New(runs);
    if (result == NULL) {
        goto done;
    }
    Py_ssize_t start = 0, run = 0;
    for (Py_ssize_t k = 1; k <= n; k++) {
        if (k < n && ids[k - 1] != LLONG_MAX && ids[k] == ids[k - 1] + 1) {
            continue;
        }
        PyObject *length = PyLong_FromSsize_t(k - start);
        PyObject *pair = length == NULL ? NULL : PyTuple_New(2);
        if (pair == NULL) {
            Py_XDECREF(length);
            Py_CLEAR(result);
            goto done;
        }
        PyTuple_SET_ITEM(pair, 0, Py_NewRef(PyTuple_GET_ITEM(block_ids, start)));
        PyTuple_SET_ITEM(pair, 1, length);
        /* Two ints cannot be part of a cycle; the collector would untrack the pair on its first
         * pass anyway, and 10,000 tracked pairs made `runs` 1.6x slower (467 vs 283 us). */
        PyObject_GC_UnTrack(pair);
        PyTuple_SET_ITEM(result, run++, pair);
        start = k;
    }
done:
    PyMem_Free(ids);
    return result;
}

/* --- The per-call passes of the GPU enqueue (issue 14, item 2) -------------------------------------
 *
 * On the H100 hosts of 2026-11-26 `random.sample` of 8 ids took 3.5 us, `struct.pack_into` of 64 ids
 * 1.4 us and every ctypes call into the CUDA driver about 0.4 us of Python around the call itself,
 * against a 30 us budget per zeroization; each pass below is one C call. */

/* floor(word * bound / 2**64): a value in [0, bound), Lemire's multiply-shift (no division). */
static inline uint64_t scaled(uint64_t word, uint64_t bound)
{
#if defined(__SIZEOF_INT128__)
    return (uint64_t)(((unsigned __int128)word * bound) >> 64);
#else
    uint64_t w_lo = word & 0xFFFFFFFFu, w_hi = word >> 32;
    uint64_t b_lo = bound & 0xFFFFFFFFu, b_hi = bound >> 32;
    uint64_t lo_lo = w_lo * b_lo, hi_lo = w_hi * b_lo, lo_hi = w_lo * b_hi;
    uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFu) + lo_hi;
    return w_hi * b_hi + (hi_lo >> 32) + (cross >> 32);
#endif
}

static int compare_positions(const void *a, const void *b)
{
    Py_ssize_t x = *(const Py_ssize_t *)a;
    Py_ssize_t y = *(const Py_ssize_t *)b;
    return (x > y) - (x < y);
}

PyDoc_STRVAR(sample_doc,
             "sample(block_ids, k, words, /)\n--\n\n"
             "k items of the tuple block_ids (1 <= k < len), as a list in the tuple's order, drawn\n"
             "by Floyd's algorithm from words (8 * k bytes: k little-endian 64-bit words): step i\n"
             "picks position j = len - k + i or below it as floor(word_i * (j + 1) / 2**64), and\n"
             "j itself when that position was picked before. verify._sample_python is the same\n"
             "draw in Python.");

static PyObject *sample(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "sample expected 3 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *block_ids = args[0];
    if (!PyTuple_CheckExact(block_ids)) {
        PyErr_SetString(PyExc_TypeError, "block_ids must be a tuple");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(block_ids);
    Py_ssize_t k = PyLong_AsSsize_t(args[1]);
    if (k == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (k < 1 || k >= n) {
        PyErr_SetString(PyExc_ValueError, "k must be at least 1 and below len(block_ids)");
        return NULL;
    }
    Py_buffer words;
    if (PyObject_GetBuffer(args[2], &words, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t *picked = NULL;
    uint64_t *seen = NULL;
    if (words.len != 8 * k) {
        PyErr_SetString(PyExc_ValueError, "words must hold 8 bytes per pick");
        goto done;
    }
    picked = PyMem_New(Py_ssize_t, (size_t)k);
    seen = PyMem_Calloc((size_t)(n >> 6) + 1, sizeof(uint64_t));
    if (picked == NULL || seen == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const unsigned char *bytes = words.buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        uint64_t word = 0;
        for (int b = 7; b >= 0; b--) { /* little-endian, whatever the host's order */
            word = (word << 8) | bytes[8 * i + b];
        }
        Py_ssize_t j = n - k + i;
        Py_ssize_t at = (Py_ssize_t)scaled(word, (uint64_t)j + 1);
        if (seen[at >> 6] & ((uint64_t)1 << (at & 63))) {
            at = j; /* never picked: every earlier pick is below j */
        }
        seen[at >> 6] |= (uint64_t)1 << (at & 63);
        picked[i] = at;
    }
    qsort(picked, (size_t)k, sizeof(Py_ssize_t), compare_positions);
    result = PyList_New(k);
    if (result == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        PyList_SET_ITEM(result, i, Py_NewRef(PyTuple_GET_ITEM(block_ids, picked[i])));
    }
done:
    PyMem_Free(seen);
    PyMem_Free(picked);
    PyBuffer_Release(&words);
    return result;
}

PyDoc_STRVAR(pack_doc,
             "pack(buffer, block_ids, at, /)\n--\n\n"
             "Write block_ids (a list or tuple) as native int64 words into the writable buffer from\n"
             "word at, as struct.pack_into(f'{len(block_ids)}q', buffer, 8 * at, *block_ids) does.\n"
             "Returns False when an item is not an exact int that fits in 64 bits (the words\n"
             "before it are written; the caller packs them in Python); ValueError when they do\n"
             "not fit in the buffer.");

static PyObject *pack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "pack expected 3 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *block_ids = args[1];
    if (!PyList_CheckExact(block_ids) && !PyTuple_CheckExact(block_ids)) {
        PyErr_SetString(PyExc_TypeError, "block_ids must be a list or a tuple");
        return NULL;
    }
    Py_ssize_t at = PyLong_AsSsize_t(args[2]);
    if (at == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(block_ids);
    if (at < 0 || n > view.len / 8 - at) {
        PyErr_SetString(PyExc_ValueError, "the ids do not fit in the buffer from word at");
        goto done;
    }
    /* No Python code runs below (exact ints only), so the list cannot change under us. */
    PyObject **items = PySequence_Fast_ITEMS(block_ids);
    char *out = (char *)view.buf + 8 * at;
    result = Py_True;
    for (Py_ssize_t i = 0; i < n; i++) {
        int overflow = 1; /* not an exact int: as if it did not fit */
        long long value = 0;
        if (PyLong_CheckExact(items[i])) {
            value = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        }
        if (overflow != 0) {
            result = Py_False;
            break;
        }
        memcpy(out + 8 * i, &value, sizeof value);
    }
    Py_INCREF(result);
done:
    PyBuffer_Release(&view);
    return result;
}

typedef int (*call2_fn)(void *, void *);
typedef int (*call3_fn)(void *, void *, void *);

PyDoc_STRVAR(call_doc,
             "call(function, a, b[, c], /)\n--\n\n"
             "Call the C function at address `function`, of type int (*)(void *, void *[, void *])\n"
             "(a CUDA driver entry point: cuGraphLaunch, cuEventRecord,\n"
             "cuGraphExecKernelNodeSetParams), with the integers a, b (and c) as pointers, without\n"
             "the GIL, as a ctypes call would; returns its int result.");

static PyObject *call(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3 && nargs != 4) {
        PyErr_Format(PyExc_TypeError, "call expected 3 or 4 arguments, got %zd", nargs);
        return NULL;
    }
    void *pointers[4];
    for (Py_ssize_t i = 0; i < nargs; i++) {
        pointers[i] = PyLong_AsVoidPtr(args[i]);
        if (pointers[i] == NULL && PyErr_Occurred()) {
            return NULL;
        }
    }
    if (pointers[0] == NULL) {
        PyErr_SetString(PyExc_ValueError, "function must not be NULL");
        return NULL;
    }
    int code;
    Py_BEGIN_ALLOW_THREADS
    if (nargs == 3) {
        code = ((call2_fn)pointers[0])(pointers[1], pointers[2]);
    }
    else {
        code = ((call3_fn)pointers[0])(pointers[1], pointers[2], pointers[3]);
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(code);
}

static PyMethodDef plan_methods[] = {
    {"unique_sorted", (PyCFunction)(void (*)(void))unique_sorted, METH_FASTCALL, unique_sorted_doc},
    {"coalesce", coalesce, METH_O, coalesce_doc},
    {"sample", (PyCFunction)(void (*)(void))sample, METH_FASTCALL, sample_doc},
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL, pack_doc},
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL, call_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef plan_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvguard.zeroize._plan",
    .m_doc = "The zeroize planner's per-id passes and the enqueue's per-call passes in C; "
             "Python falls back without it.",
    .m_size = 0,
    .m_methods = plan_methods,
};

PyMODINIT_FUNC PyInit__plan(void) { return PyModuleDef_Init(&plan_module); }
