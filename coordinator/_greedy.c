/* The longest-first greedy of coordinator.balance, compiled: the planner lays out tens of
 * thousands of pieces per step within a budget of milliseconds, and the rule is inherently one
 * piece at a time. This is a line-by-line port of balance._greedy_loop (the Python reference,
 * also the fallback when this module is not built); tests check both give identical layouts.
 *
 * Rule, for each fragment in greedy order (costliest first):
 *   - the cheapest rank (lowest cost, then lowest index) that has a row with room for the whole
 *     fragment; in it the cheapest micro-batch, then the cheapest row, with room (lowest index on
 *     ties). If that rank would pass `cost_cap`, the fragment is cut so its head brings the rank
 *     to the cap (both parts at least MIN_SPLIT tokens), and the rest goes back into the queue;
 *   - if no rank has room for the whole fragment, its head fills the roomiest row of the rank
 *     with the roomiest row, and the rest goes back into the queue.
 * Ranks without room for the current fragment are parked in a heap by room and come back as soon
 * as a fragment fits (fragments only get shorter, except by cost order with image patches).
 *
 * Only the buffer protocol is used (no numpy headers): arrays come in as contiguous buffers. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MIN_SPLIT 128

typedef struct { double negkey; int64_t piece, offset, length; } Frag;      /* the queue */
typedef struct { double key; int64_t rank, version; } Avail;                 /* ranks by cost */
typedef struct { int64_t negroom, rank, version; } Parked;                   /* ranks by room */

static int frag_less(const Frag *a, const Frag *b) {
    if (a->negkey != b->negkey) return a->negkey < b->negkey;
    if (a->piece != b->piece) return a->piece < b->piece;
    if (a->offset != b->offset) return a->offset < b->offset;
    return a->length < b->length;
}
static int frag_cmp(const void *a, const void *b) {
    return frag_less(a, b) ? -1 : frag_less(b, a) ? 1 : 0;
}
static int avail_less(const Avail *a, const Avail *b) {
    if (a->key != b->key) return a->key < b->key;
    if (a->rank != b->rank) return a->rank < b->rank;
    return a->version < b->version;
}
static int parked_less(const Parked *a, const Parked *b) {
    if (a->negroom != b->negroom) return a->negroom < b->negroom;
    if (a->rank != b->rank) return a->rank < b->rank;
    return a->version < b->version;
}

/* Binary min-heaps over a growable array, one set of functions per element type. */
#define HEAP(T, LESS)                                                                          \
    typedef struct { T *a; Py_ssize_t n, cap; } T##Heap;                                       \
    static inline int T##_push(T##Heap *h, T x) {                                                     \
        if (h->n == h->cap) {                                                                  \
            Py_ssize_t cap = h->cap ? 2 * h->cap : 64;                                         \
            T *a = realloc(h->a, (size_t)cap * sizeof(T));                                     \
            if (!a) return -1;                                                                 \
            h->a = a; h->cap = cap;                                                            \
        }                                                                                      \
        Py_ssize_t i = h->n++;                                                                 \
        while (i > 0) {                                                                        \
            Py_ssize_t p = (i - 1) / 2;                                                        \
            if (!LESS(&x, &h->a[p])) break;                                                    \
            h->a[i] = h->a[p]; i = p;                                                          \
        }                                                                                      \
        h->a[i] = x;                                                                           \
        return 0;                                                                              \
    }                                                                                          \
    static inline void T##_sift(T##Heap *h, Py_ssize_t i) {                                           \
        T x = h->a[i];                                                                         \
        for (;;) {                                                                             \
            Py_ssize_t c = 2 * i + 1;                                                          \
            if (c >= h->n) break;                                                              \
            if (c + 1 < h->n && LESS(&h->a[c + 1], &h->a[c])) c++;                             \
            if (!LESS(&h->a[c], &x)) break;                                                    \
            h->a[i] = h->a[c]; i = c;                                                          \
        }                                                                                      \
        h->a[i] = x;                                                                           \
    }                                                                                          \
    static inline T T##_pop(T##Heap *h) {                                                             \
        T top = h->a[0];                                                                       \
        h->a[0] = h->a[--h->n];                                                                \
        if (h->n) T##_sift(h, 0);                                                              \
        return top;                                                                            \
    }                                                                                          \
    static inline void T##_replace(T##Heap *h, T x) { h->a[0] = x; T##_sift(h, 0); }

HEAP(Frag, frag_less)
HEAP(Avail, avail_less)
HEAP(Parked, parked_less)

enum { AVAILABLE, PARKED, FULL };

typedef struct {
    /* coefficients: per piece (qs, lins) or one pair for every piece */
    const double *qs, *lins;
    double q, lin;
    /* the grid */
    Py_ssize_t ranks, rows_per_rank, mbs;
    /* state, updated in place: room and cost per row, cost per micro-batch and per rank */
    int64_t *room;
    double *row_cost, *mb_cost, *rank_cost;
    double cost_cap;
    /* output: fragments placed (piece, offset, length, row), `count` of them so far */
    int64_t *out_piece, *out_offset, *out_length, *out_row;
    Py_ssize_t count, out_cap;
} Problem;

static int64_t head_for(double budget, double q, double lin) {
    if (budget <= 0) return 0;
    if (q > 0) return (int64_t)((-lin + sqrt(lin * lin + 4 * q * budget)) / (2 * q));
    return lin > 0 ? (int64_t)(budget / lin) : ((int64_t)1 << 62);
}

static int64_t rank_room_of(const Problem *p, Py_ssize_t r) {
    int64_t best = p->room[r * p->rows_per_rank];
    for (Py_ssize_t i = 1; i < p->rows_per_rank; i++)
        if (p->room[r * p->rows_per_rank + i] > best) best = p->room[r * p->rows_per_rank + i];
    return best;
}

/* cheapest micro-batch, then cheapest row, with room for `length` (lowest index on ties) */
static Py_ssize_t fitting_row(const Problem *p, Py_ssize_t rank, int64_t length) {
    Py_ssize_t first = rank * p->rows_per_rank, best = -1;
    for (Py_ssize_t r = first; r < first + p->rows_per_rank; r++) {
        if (p->room[r] < length) continue;
        if (best < 0) { best = r; continue; }
        double mb = p->mb_cost[r / p->mbs], mb_best = p->mb_cost[best / p->mbs];
        if (mb < mb_best || (mb == mb_best && p->row_cost[r] < p->row_cost[best])) best = r;
    }
    return best;
}

static Py_ssize_t roomiest_row(const Problem *p, Py_ssize_t rank) {
    Py_ssize_t first = rank * p->rows_per_rank, best = first;
    for (Py_ssize_t r = first + 1; r < first + p->rows_per_rank; r++)
        if (p->room[r] > p->room[best]) best = r;
    return best;
}

static double frag_key(const Problem *p, int64_t piece, int64_t length) {
    if (!p->qs) return (double)length;
    return p->qs[piece] * (double)length * (double)length + p->lins[piece] * (double)length;
}

/* The greedy over fragments [0, n) of the given arrays. Returns 0, or -1 with an exception set. */
static int run(Problem *p, const int64_t *piece, const int64_t *offset, const int64_t *length, Py_ssize_t n) {
    FragHeap queue = {0};
    Frag *sorted = NULL;
    AvailHeap available = {0};
    ParkedHeap parked = {0};
    Py_ssize_t R = p->ranks, rpr = p->rows_per_rank;
    int *state = calloc((size_t)R, sizeof(int));
    int64_t *version = calloc((size_t)R, sizeof(int64_t));
    int64_t *rank_room = malloc((size_t)R * sizeof(int64_t));
    int ok = -1;
    if (!state || !version || !rank_room) { PyErr_NoMemory(); goto done; }
    /* the queue: the fragments sorted (a cursor over them) merged with a heap of cut rests */
    sorted = malloc((size_t)(n ? n : 1) * sizeof(Frag));
    if (!sorted) { PyErr_NoMemory(); goto done; }
    int in_order = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Frag f = {-frag_key(p, piece[i], length[i]), piece[i], offset[i], length[i]};
        sorted[i] = f;
        if (i && frag_less(&sorted[i], &sorted[i - 1])) in_order = 0;
    }
    if (!in_order) qsort(sorted, (size_t)n, sizeof(Frag), frag_cmp);
    Py_ssize_t next = 0;
    for (Py_ssize_t r = 0; r < R; r++) {
        rank_room[r] = rank_room_of(p, r);
        state[r] = rank_room[r] > 0 ? AVAILABLE : FULL;
        if (state[r] == AVAILABLE) {
            Avail a = {p->rank_cost[r], r, 0};
            if (Avail_push(&available, a)) { PyErr_NoMemory(); goto done; }
        }
    }
    while (next < n || queue.n) {
        Frag f = (next < n && (!queue.n || frag_less(&sorted[next], &queue.a[0]))) ? sorted[next++] : Frag_pop(&queue);
        double q = p->qs ? p->qs[f.piece] : p->q, lin = p->lins ? p->lins[f.piece] : p->lin;
        int64_t len = f.length;
        while (parked.n && -parked.a[0].negroom >= len) {  /* ranks with room again for pieces this small */
            Parked e = Parked_pop(&parked);
            if (state[e.rank] == PARKED && e.version == version[e.rank]) {
                state[e.rank] = AVAILABLE;
                Avail a = {p->rank_cost[e.rank], e.rank, e.version};
                if (Avail_push(&available, a)) { PyErr_NoMemory(); goto done; }
            }
        }
        Py_ssize_t rank = -1;
        while (available.n) {
            Avail top = available.a[0];
            if (state[top.rank] != AVAILABLE || top.version != version[top.rank]) {
                Avail_pop(&available);  /* stale entry */
            } else if (rank_room[top.rank] >= len) {
                rank = top.rank;
                break;
            } else {
                Avail_pop(&available);
                state[top.rank] = PARKED;
                Parked e = {-rank_room[top.rank], top.rank, top.version};
                if (Parked_push(&parked, e)) { PyErr_NoMemory(); goto done; }
            }
        }
        int from_top = rank >= 0;
        int64_t take;
        Py_ssize_t row;
        if (from_top) {
            take = len;
            double over = p->rank_cost[rank] + q * (double)len * (double)len + lin * (double)len - p->cost_cap;
            if (over > 0 && len >= 2 * MIN_SPLIT) {
                int64_t head = head_for(p->cost_cap - p->rank_cost[rank], q, lin);
                if (head >= MIN_SPLIT && head <= len - MIN_SPLIT) {
                    take = head;
                    int64_t rest = len - take;
                    Frag r = {-frag_key(p, f.piece, rest), f.piece, f.offset + take, rest};
                    if (Frag_push(&queue, r)) { PyErr_NoMemory(); goto done; }
                }
            }
            row = fitting_row(p, rank, take);
        } else {  /* no rank has room for all of it: its head fills the roomiest row of the roomiest rank */
            while (parked.n && (state[parked.a[0].rank] != PARKED || parked.a[0].version != version[parked.a[0].rank]))
                Parked_pop(&parked);
            if (!parked.n) {
                PyErr_SetString(PyExc_ValueError, "pieces hold more tokens than the rows");
                goto done;
            }
            rank = parked.a[0].rank;
            row = roomiest_row(p, rank);
            take = p->room[row];
            int64_t rest = len - take;
            Frag r = {-frag_key(p, f.piece, rest), f.piece, f.offset + take, rest};
            if (Frag_push(&queue, r)) { PyErr_NoMemory(); goto done; }
        }
        if (p->count >= p->out_cap) {
            PyErr_SetString(PyExc_ValueError, "output arrays too small");
            goto done;
        }
        p->out_piece[p->count] = f.piece;
        p->out_offset[p->count] = f.offset;
        p->out_length[p->count] = take;
        p->out_row[p->count] = row;
        p->count++;
        double c = q * (double)take * (double)take + lin * (double)take;
        p->room[row] -= take;
        p->row_cost[row] += c;
        p->mb_cost[row / p->mbs] += c;
        p->rank_cost[rank] += c;
        rank_room[rank] = rpr == 1 ? p->room[row] : rank_room_of(p, rank);
        version[rank] += 1;
        /* the placed rank's entry is its heap's top: replace it in place */
        if (rank_room[rank] == 0) {
            state[rank] = FULL;
            if (from_top) Avail_pop(&available); else Parked_pop(&parked);
        } else if (from_top) {
            Avail a = {p->rank_cost[rank], rank, version[rank]};
            Avail_replace(&available, a);
        } else {
            Parked e = {-rank_room[rank], rank, version[rank]};
            Parked_replace(&parked, e);
        }
    }
    ok = 0;
done:
    free(sorted); free(queue.a); free(available.a); free(parked.a);
    free(state); free(version); free(rank_room);
    return ok;
}

/* A contiguous buffer of `count` items of `size` bytes (count < 0: any), or an error. */
static int get(PyObject *obj, Py_buffer *view, Py_ssize_t size, Py_ssize_t count, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->itemsize != size || (count >= 0 && view->len != count * size)) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd items of %zd bytes, got %zd bytes of items of %zd",
                     name, count, size, view->len, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(greedy_doc,
"greedy(piece, offset, length, qs, lins, q, lin, grid, room, row_cost, mb_cost, rank_cost, cost_cap,\n"
"       groups, out_piece, out_offset, out_length, out_row) -> count\n\n"
"See coordinator.balance._greedy_loop: the same rule, the same result. `groups` is None, or the\n"
"bounds (ranks + 1 int64) of each rank's fragments, laid out on that rank's rows alone.");

static PyObject *greedy(PyObject *self, PyObject *args) {
    PyObject *o_piece, *o_offset, *o_length, *o_qs, *o_lins, *o_room, *o_row_cost, *o_mb_cost, *o_rank_cost;
    PyObject *o_groups, *o_out[4];
    double q, lin, cost_cap;
    Py_ssize_t ranks, micro_batches, mbs, row_capacity;
    if (!PyArg_ParseTuple(args, "OOOOOdd(nnnn)OOOOdOOOOO", &o_piece, &o_offset, &o_length, &o_qs, &o_lins, &q, &lin,
                          &ranks, &micro_batches, &mbs, &row_capacity, &o_room, &o_row_cost, &o_mb_cost,
                          &o_rank_cost, &cost_cap, &o_groups, &o_out[0], &o_out[1], &o_out[2], &o_out[3]))
        return NULL;
    (void)row_capacity;
    if (ranks <= 0 || micro_batches <= 0 || mbs <= 0) {
        PyErr_SetString(PyExc_ValueError, "empty grid");
        return NULL;
    }
    Py_ssize_t rpr = micro_batches * mbs;
    Py_buffer b[13];
    int held = 0;
    PyObject *result = NULL;
    Problem p = {0};
#define GET(obj, count, writable, name) \
    if (get(obj, &b[held], 8, count, writable, name) < 0) goto fail; \
    held++;
    GET(o_piece, -1, 0, "piece")
    Py_ssize_t n = b[0].len / 8;
    GET(o_offset, n, 0, "offset")
    GET(o_length, n, 0, "length")
    if (o_qs != Py_None) {
        GET(o_qs, -1, 0, "qs")
        p.qs = b[held - 1].buf;
        Py_ssize_t pieces = b[held - 1].len / 8;
        GET(o_lins, pieces, 0, "lins")
        p.lins = b[held - 1].buf;
        const int64_t *ids = b[0].buf;
        for (Py_ssize_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= pieces) {
                PyErr_Format(PyExc_ValueError, "piece %lld has no coefficients (%zd pieces)", (long long)ids[i], pieces);
                goto fail;
            }
    }
    GET(o_room, ranks * rpr, 1, "room")
    p.room = b[held - 1].buf;
    GET(o_row_cost, ranks * rpr, 1, "row_cost")
    p.row_cost = b[held - 1].buf;
    GET(o_mb_cost, ranks * micro_batches, 1, "mb_cost")
    p.mb_cost = b[held - 1].buf;
    GET(o_rank_cost, ranks, 1, "rank_cost")
    p.rank_cost = b[held - 1].buf;
    int out_first = held;
    for (int i = 0; i < 4; i++) {
        GET(o_out[i], -1, 1, "out")
    }
#undef GET
    p.out_cap = b[out_first].len / 8;
    for (int i = 1; i < 4; i++)
        if (b[out_first + i].len / 8 < p.out_cap) p.out_cap = b[out_first + i].len / 8;
    p.out_piece = b[out_first].buf; p.out_offset = b[out_first + 1].buf;
    p.out_length = b[out_first + 2].buf; p.out_row = b[out_first + 3].buf;
    p.q = q; p.lin = lin; p.cost_cap = cost_cap; p.rows_per_rank = rpr; p.mbs = mbs;
    const int64_t *piece = b[0].buf, *offset = b[1].buf, *length = b[2].buf;
    if (o_groups == Py_None) {
        p.ranks = ranks;
        if (run(&p, piece, offset, length, n) < 0) goto fail;
    } else {  /* each rank's fragments on its own rows: a one-rank problem per rank */
        Py_buffer g;
        if (get(o_groups, &g, 8, ranks + 1, 0, "groups") < 0) goto fail;
        const int64_t *bounds = g.buf;
        Problem one = p;
        one.ranks = 1;
        for (Py_ssize_t r = 0; r < ranks; r++) {
            int64_t lo = bounds[r], hi = bounds[r + 1];
            if (lo < 0 || hi < lo || hi > n) {
                PyErr_SetString(PyExc_ValueError, "groups out of range");
                PyBuffer_Release(&g);
                goto fail;
            }
            one.room = p.room + r * rpr; one.row_cost = p.row_cost + r * rpr;
            one.mb_cost = p.mb_cost + r * micro_batches; one.rank_cost = p.rank_cost + r;
            Py_ssize_t first = one.count;
            if (run(&one, piece + lo, offset + lo, length + lo, hi - lo) < 0) { PyBuffer_Release(&g); goto fail; }
            for (Py_ssize_t i = first; i < one.count; i++) one.out_row[i] += r * rpr;
        }
        p.count = one.count;
        PyBuffer_Release(&g);
    }
    result = PyLong_FromSsize_t(p.count);
fail:
    for (int i = 0; i < held; i++) PyBuffer_Release(&b[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"greedy", greedy, METH_VARARGS, greedy_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "coordinator._greedy",
    "The longest-first greedy of coordinator.balance, compiled.", -1, methods,
};

PyMODINIT_FUNC PyInit__greedy(void) { return PyModule_Create(&module); }
