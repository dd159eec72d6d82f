/* The keyed permutation of coordinator.cursor, compiled: the coordinator maps thousands of stream
 * positions to records per step, and the numpy version spends most of its time in per-call
 * overhead of the cycle-walking loop (dozens of passes over ever fewer elements). A line-by-line
 * port of Permutation.__call__ (splitmix64 rounds of a balanced Feistel network, cycle walking
 * until the value is below n); tests check it gives the same values as the Python reference,
 * which is also the fallback when this module is not built.
 *
 * Only the buffer protocol is used (no numpy headers). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MAX_ROUNDS 16

static inline uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

PyDoc_STRVAR(permute_doc,
"permute(values, n, half_bits, round_keys) -> None\n\n"
"Replace each uint64 of the writable buffer `values` (each below 2^(2*half_bits)) by its image\n"
"under coordinator.cursor.Permutation: Feistel rounds keyed by `round_keys` (a sequence of ints),\n"
"repeated until the value is below n.");

static PyObject *permute(PyObject *self, PyObject *args) {
    PyObject *o_values, *o_keys;
    unsigned long long n;
    int half;
    if (!PyArg_ParseTuple(args, "OKiO", &o_values, &n, &half, &o_keys))
        return NULL;
    if (half < 1 || half > 31 || n == 0 || n > (1ULL << (2 * half))) {
        PyErr_SetString(PyExc_ValueError, "permute: need 1 <= half_bits <= 31 and 0 < n <= 2^(2*half_bits)");
        return NULL;
    }
    PyObject *keys_seq = PySequence_Fast(o_keys, "permute: round_keys must be a sequence");
    if (keys_seq == NULL)
        return NULL;
    Py_ssize_t rounds = PySequence_Fast_GET_SIZE(keys_seq);
    uint64_t keys[MAX_ROUNDS];
    if (rounds > MAX_ROUNDS) {
        Py_DECREF(keys_seq);
        PyErr_SetString(PyExc_ValueError, "permute: too many round keys");
        return NULL;
    }
    for (Py_ssize_t r = 0; r < rounds; r++) {
        keys[r] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(keys_seq, r));
        if (PyErr_Occurred()) {
            Py_DECREF(keys_seq);
            return NULL;
        }
    }
    Py_DECREF(keys_seq);
    Py_buffer view;
    if (PyObject_GetBuffer(o_values, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return NULL;
    if (view.itemsize != 8) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "permute: values must be 8-byte unsigned integers");
        return NULL;
    }
    uint64_t *values = view.buf;
    Py_ssize_t count = view.len / 8;
    const uint64_t mask = (1ULL << half) - 1, domain = 1ULL << (2 * half);
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t x = values[i];
        if (x >= domain) {
            bad = 1;
            break;
        }
        do {  /* cycle walking: the domain is < 4n, so a few rounds on average */
            uint64_t left = x >> half, right = x & mask;
            for (Py_ssize_t r = 0; r < rounds; r++) {
                uint64_t next = left ^ (splitmix64(right ^ keys[r]) & mask);
                left = right;
                right = next;
            }
            x = (left << half) | right;
        } while (x >= n);
        values[i] = x;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "permute: a value lies outside the permutation's domain");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"permute", permute, METH_VARARGS, permute_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "coordinator._feistel",
    "The keyed permutation of coordinator.cursor, compiled.", -1, methods,
};

PyMODINIT_FUNC PyInit__feistel(void) { return PyModule_Create(&module); }
