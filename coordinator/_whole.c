/* The layout of whole samples (coordinator.balance.whole_layout), compiled: at a thousand ranks
 * a step holds ten thousand samples and needs thousands of exchanges, each a search over every
 * other rank's samples. `place` is a port of balance._place_whole and `exchange` of
 * balance._exchange_rounds (the Python references, also the fallback when this module is not
 * built); tests check both give identical layouts.
 *
 * place: each sample in the order given, unless it would take the step past `budget` tokens,
 * to the cheapest rank (lowest index on ties) that has a row with room for it, into the
 * tightest such row (lowest index on ties); a sample no row has room for is left out (-1).
 *
 * exchange, each round: the busiest rank b (lowest index on ties) stops the rounds once it is at
 * `level` or below. Otherwise one of its samples x is exchanged for an offer of another rank r:
 * one sample of r (a single), or two of r's `pair_from` cheapest (a pair), that costs less than
 * x, whose tokens are at most x's plus the free room of x's row, and where the first offered
 * sample's row has room for x once the offer leaves it. The exchange chosen leaves the costlier
 * of b and r cheapest (max(cost_b - d, cost_r + d), d the cost moved), and must leave it below
 * cost_b; ties go to a single, then the lowest x, then the lowest single, or the lowest rank
 * then pair.
 *
 * Offers are kept in buckets, each in order of cost, so a bucket's search ends at the first offer
 * too costly to win: by their tokens, or by the room they leave for x when their row has room
 * past them ("loose": only such an offer can take a sample longer than itself, and with full
 * rows there are few). The two ranks of an exchange take their offers out before it and put
 * fresh ones in after. Only the buffer protocol is used (no numpy headers). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

typedef struct { double cost; int64_t y, z, rank, order; } Offer;  /* z = -1: a single; order: the pair's index */
typedef struct { Offer *a; Py_ssize_t n, cap; } Bucket;

typedef struct {
    const int64_t *n;
    const double *c;
    int64_t *at, *free;
    double *rank_cost;
    Py_ssize_t samples, ranks, per_rank, cap, pair_from;
    int64_t *head, *next, *prev;            /* each rank's samples, a doubly linked list */
    int64_t *mine;                          /* the busiest rank's samples, costliest first */
    int nonnegative;                        /* no sample costs less than nothing: searches may stop early */
    Bucket *buckets;                        /* [single, pair][tight: by tokens, loose: by room][0..cap] */
    double *cheapest[2];                    /* singles, pairs: a tree over the loose buckets, of their
                                               cheapest offer (leaves from `leaves` on; none: +inf) */
    Py_ssize_t leaves;
    Offer *listed;                          /* one rank's offers (list_offers) */
    int64_t *listed_at;                     /* and their buckets */
} Ex;

static int bucket_add(Bucket *b, Offer o) {  /* kept in order of cost: a search stops at the first too costly */
    if (b->n == b->cap) {
        Py_ssize_t cap = b->cap ? 2 * b->cap : 8;
        Offer *a = realloc(b->a, (size_t)cap * sizeof(Offer));
        if (!a) return -1;
        b->a = a; b->cap = cap;
    }
    Py_ssize_t lo = 0, hi = b->n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (b->a[mid].cost <= o.cost) lo = mid + 1; else hi = mid;
    }
    memmove(b->a + lo + 1, b->a + lo, (size_t)(b->n - lo) * sizeof(Offer));
    b->a[lo] = o;
    b->n++;
    return 0;
}

static void unlink_sample(Ex *e, int64_t i, int64_t r) {
    if (e->prev[i] >= 0) e->next[e->prev[i]] = e->next[i]; else e->head[r] = e->next[i];
    if (e->next[i] >= 0) e->prev[e->next[i]] = e->prev[i];
}

static void link_sample(Ex *e, int64_t i, int64_t r) {
    e->prev[i] = -1;
    e->next[i] = e->head[r];
    if (e->head[r] >= 0) e->prev[e->head[r]] = i;
    e->head[r] = i;
}

static int cheaper(const Ex *e, int64_t a, int64_t b) {  /* by cost, then position */
    return e->c[a] < e->c[b] || (e->c[a] == e->c[b] && a < b);
}

static Bucket *bucket_of(const Ex *e, int pairs, int loose, int64_t tokens) {
    return &e->buckets[(2 * pairs + loose) * (e->cap + 1) + tokens];
}

/* Rank r's offers as it is now, into e->listed and e->listed_at (bucket indices): each of its
 * samples, and each two of its pair_from cheapest. */
static Py_ssize_t list_offers(Ex *e, int64_t r) {
    int64_t cheap[64];
    Py_ssize_t k = 0, pf = e->pair_from, count = 0;
    for (int64_t i = e->head[r]; i >= 0; i = e->next[i]) {
        Offer o = {e->c[i], i, -1, r, 0};
        int64_t room = e->free[e->at[i]] + e->n[i];
        e->listed[count] = o;
        e->listed_at[count++] = bucket_of(e, 0, room > e->n[i], room > e->n[i] ? room : e->n[i]) - e->buckets;
        /* keep the pf cheapest, in order */
        Py_ssize_t at = k < pf ? k : pf;
        while (at > 0 && cheaper(e, i, cheap[at - 1])) at--;
        if (at < pf) {
            Py_ssize_t last = k < pf ? k : pf - 1;
            memmove(cheap + at + 1, cheap + at, (size_t)(last - at) * sizeof(int64_t));
            cheap[at] = i;
            if (k < pf) k++;
        }
    }
    int64_t t = 0;
    for (Py_ssize_t a = 0; a < pf; a++)
        for (Py_ssize_t b = a + 1; b < pf; b++, t++) {
            if (b >= k) continue;
            int64_t y = cheap[a], z = cheap[b], got = e->n[y] + e->n[z];
            if (got > e->cap) continue;
            int64_t room = e->free[e->at[y]] + e->n[y] + (e->at[z] == e->at[y] ? e->n[z] : 0);
            Offer o = {e->c[y] + e->c[z], y, z, r, t};
            e->listed[count] = o;
            e->listed_at[count++] = bucket_of(e, 1, room > got, room > got ? room : got) - e->buckets;
        }
    return count;
}

static void mark(Ex *e, int64_t at) {  /* a loose bucket's cheapest offer, up its tree */
    int64_t per = e->cap + 1, kind = at / per, g = at % per;
    if (!(kind & 1)) return;
    double *tree = e->cheapest[kind >> 1];
    Py_ssize_t i = e->leaves + g;
    tree[i] = e->buckets[at].n ? e->buckets[at].a[0].cost : HUGE_VAL;
    for (i /= 2; i >= 1; i /= 2) tree[i] = tree[2 * i] < tree[2 * i + 1] ? tree[2 * i] : tree[2 * i + 1];
}

static int add_offers(Ex *e, int64_t r) {
    Py_ssize_t count = list_offers(e, r);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (bucket_add(&e->buckets[e->listed_at[i]], e->listed[i]) < 0) return -1;
        mark(e, e->listed_at[i]);
    }
    return 0;
}

static void remove_offers(Ex *e, int64_t r) {  /* before its samples or rows change */
    Py_ssize_t count = list_offers(e, r);
    for (Py_ssize_t i = 0; i < count; i++) {
        Bucket *b = &e->buckets[e->listed_at[i]];
        const Offer *o = &e->listed[i];
        Py_ssize_t lo = 0, hi = b->n;
        while (lo < hi) {
            Py_ssize_t mid = (lo + hi) / 2;
            if (b->a[mid].cost < o->cost) lo = mid + 1; else hi = mid;
        }
        for (; lo < b->n && b->a[lo].cost == o->cost; lo++)
            if (b->a[lo].y == o->y && b->a[lo].z == o->z) {
                memmove(b->a + lo, b->a + lo + 1, (size_t)(b->n - lo - 1) * sizeof(Offer));
                b->n--;
                mark(e, e->listed_at[i]);
                break;
            }
    }
}

typedef struct { double after; int64_t x, y, z, rank, order, got; double delta; int found; } Best;

/* Is candidate (after, x, key...) before the best so far? Singles: x then y; pairs: x, rank, order. */
static int better_single(const Best *b, double after, int64_t x, int64_t y) {
    if (!b->found) return 1;
    if (after != b->after) return after < b->after;
    if (x != b->x) return x < b->x;
    return y < b->y;
}
static int better_pair(const Best *b, double after, int64_t x, int64_t rank, int64_t order) {
    if (!b->found) return 1;
    if (after != b->after) return after < b->after;
    if (x != b->x) return x < b->x;
    if (rank != b->rank) return rank < b->rank;
    return order < b->order;
}

static void costlier_first(const Ex *e, int64_t *a, Py_ssize_t k) {  /* insertion sort: a rank holds few */
    for (Py_ssize_t i = 1; i < k; i++) {
        int64_t v = a[i];
        Py_ssize_t j = i;
        while (j > 0 && (e->c[a[j - 1]] < e->c[v] || (e->c[a[j - 1]] == e->c[v] && a[j - 1] > v))) {
            a[j] = a[j - 1];
            j--;
        }
        a[j] = v;
    }
}

/* Offers of one bucket (of `tokens` tokens) for b's sample x, into best. */
static void scan_bucket(const Ex *e, const Bucket *bk, int64_t b, double cb, double limit, int64_t x, int pairs,
                        Best *best, const Best *other) {
    double cx = e->c[x];
    int64_t nx = e->n[x], most = nx + e->free[e->at[x]];  /* x's row takes at most this */
    for (Py_ssize_t j = 0; j < bk->n; j++) {
        const Offer *o = &bk->a[j];
        double delta = cx - o->cost, a1 = cb - delta;
        if (!(a1 < limit) || (best->found && a1 > best->after) || (other->found && a1 > other->after)) break;
        if (o->rank == b || !(delta > 0)) continue;
        int64_t got = e->n[o->y] + (o->z >= 0 ? e->n[o->z] : 0);
        if (got > most) continue;
        int64_t room = e->free[e->at[o->y]] + e->n[o->y];
        if (o->z >= 0 && e->at[o->z] == e->at[o->y]) room += e->n[o->z];
        if (room < nx) continue;
        double a2 = e->rank_cost[o->rank] + delta;
        double after = a1 > a2 ? a1 : a2;
        if (!(after < limit)) continue;
        if (pairs ? better_pair(best, after, x, o->rank, o->order) : better_single(best, after, x, o->y)) {
            Best nb = {after, x, o->y, o->z, o->rank, o->order, got, delta, 1};
            *best = nb;
        }
    }
}

/* Loose buckets of room from `from` up, under node i (covering [lo, hi]), that hold an offer
 * cheap enough to beat the best so far. */
static void scan_loose(const Ex *e, int pairs, Py_ssize_t i, int64_t lo, int64_t hi, int64_t from, int64_t b,
                       double cb, double limit, int64_t x, Best *best, const Best *other) {
    if (hi < from || lo > e->cap) return;
    double a1 = cb - e->c[x] + e->cheapest[pairs][i];  /* the least the busiest rank keeps */
    if (!(a1 < limit) || (best->found && a1 > best->after) || (other->found && a1 > other->after)) return;
    if (lo == hi) {
        scan_bucket(e, bucket_of(e, pairs, 1, lo), b, cb, limit, x, pairs, best, other);
        return;
    }
    int64_t mid = (lo + hi) / 2;
    scan_loose(e, pairs, 2 * i, lo, mid, from, b, cb, limit, x, best, other);
    scan_loose(e, pairs, 2 * i + 1, mid + 1, hi, from, b, cb, limit, x, best, other);
}

/* The best exchange of one of b's k samples (e->mine, costliest first) for a single (into bs)
 * and for a pair (into bp). Offers come cheapest first in a bucket, so a bucket's search stops
 * at the first whose exchange could not beat the best so far, and the samples' at the first
 * whose whole cost could not. Tight offers (no room past them in their row) are bucketed by
 * their tokens, which must be from x's up to x's plus its row's room; loose ones by the room
 * they leave, at least x's tokens, found through a tree of each loose bucket's cheapest offer. */
static void search(const Ex *e, int64_t b, double cb, double limit, Py_ssize_t k, Best *bs, Best *bp) {
    for (Py_ssize_t m = 0; m < k; m++) {
        int64_t x = e->mine[m];
        double cx = e->c[x];
        int64_t nx = e->n[x], fx = e->free[e->at[x]];
        if (e->nonnegative && (cb - cx >= limit || (bs->found && cb - cx > bs->after)
                               || (bp->found && cb - cx > bp->after)))
            break;
        for (int pairs = 0; pairs < 2; pairs++) {
            Best *best = pairs ? bp : bs;
            const Best *other = pairs ? bs : bp;
            int64_t hi = nx + fx < e->cap ? nx + fx : e->cap;
            for (int64_t g = nx; g <= hi; g++)
                scan_bucket(e, bucket_of(e, pairs, 0, g), b, cb, limit, x, pairs, best, other);
            scan_loose(e, pairs, 1, 0, e->leaves - 1, nx, b, cb, limit, x, best, other);
        }
    }
}

static Py_ssize_t run(Ex *e, double level, Py_ssize_t max_rounds) {
    Py_ssize_t rounds = 0;
    e->nonnegative = 1;
    for (Py_ssize_t i = 0; i < e->samples; i++) if (e->c[i] < 0) e->nonnegative = 0;
    for (; rounds < max_rounds; rounds++) {
        int64_t b = 0;
        for (Py_ssize_t r = 1; r < e->ranks; r++) if (e->rank_cost[r] > e->rank_cost[b]) b = r;
        double cb = e->rank_cost[b];
        if (cb <= level) break;
        double limit = cb * (1 - 1e-9);
        Best bs = {0}, bp = {0};
        Py_ssize_t k = 0;
        for (int64_t x = e->head[b]; x >= 0; x = e->next[x]) e->mine[k++] = x;
        costlier_first(e, e->mine, k);
        search(e, b, cb, limit, k, &bs, &bp);
        const Best *best = bs.found && (!bp.found || bs.after <= bp.after) ? &bs : bp.found ? &bp : NULL;
        if (!best) break;
        int64_t i = best->x, r = best->rank, theirs[2] = {best->y, best->z};
        remove_offers(e, b);
        remove_offers(e, r);
        int64_t row_i = e->at[i], row_j = e->at[best->y];
        e->free[row_i] += e->n[i] - best->got;
        e->free[row_j] -= e->n[i];
        for (int t = 0; t < 2; t++) {
            int64_t s = theirs[t];
            if (s < 0) continue;
            e->free[e->at[s]] += e->n[s];
            e->at[s] = row_i;
            unlink_sample(e, s, r);
            link_sample(e, s, b);
        }
        e->at[i] = row_j;
        unlink_sample(e, i, b);
        link_sample(e, i, r);
        e->rank_cost[b] -= best->delta;
        e->rank_cost[r] += best->delta;
        if (add_offers(e, b) < 0 || add_offers(e, r) < 0) return -1;
    }
    return rounds;
}

/* The buffer of obj, of 8-byte items, `count` of them (any number if count < 0): how many, or -1. */
static Py_ssize_t get(PyObject *obj, Py_buffer *view, Py_ssize_t count, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->itemsize != 8 || (count >= 0 && view->len != 8 * count)) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd items of 8 bytes, got %zd bytes of items of %zd",
                     name, count, view->len, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return view->len / 8;
}

PyDoc_STRVAR(exchange_doc,
"exchange(n, c, at, free, rank_cost, per_rank, row_capacity, pair_from, level, max_rounds) -> rounds\n\n"
"Exchanges whole samples between ranks by the rule of coordinator.balance._exchange_rounds, in place on\n"
"at (int64 row of each sample), free (int64 per row) and rank_cost (float64 per rank).");

static PyObject *exchange(PyObject *self, PyObject *args) {
    PyObject *o_n, *o_c, *o_at, *o_free, *o_cost;
    Py_ssize_t per_rank, cap, pair_from, max_rounds;
    double level;
    if (!PyArg_ParseTuple(args, "OOOOOnnndn", &o_n, &o_c, &o_at, &o_free, &o_cost, &per_rank, &cap, &pair_from,
                          &level, &max_rounds))
        return NULL;
    if (per_rank <= 0 || cap <= 0 || pair_from < 2 || pair_from > 64) {
        PyErr_SetString(PyExc_ValueError, "exchange: bad per_rank, row_capacity or pair_from");
        return NULL;
    }
    Py_buffer b[5];
    int held = 0;
    PyObject *result = NULL;
    Ex e;
    memset(&e, 0, sizeof e);
    Py_ssize_t samples = get(o_n, &b[0], -1, 0, "n"), ranks;
    if (samples < 0) return NULL;
    held = 1;
    if (get(o_c, &b[1], samples, 0, "c") < 0) goto fail;
    held = 2;
    if (get(o_at, &b[2], samples, 1, "at") < 0) goto fail;
    held = 3;
    if ((ranks = get(o_cost, &b[3], -1, 1, "rank_cost")) < 0) goto fail;
    held = 4;
    if (get(o_free, &b[4], ranks * per_rank, 1, "free") < 0) goto fail;
    held = 5;
    e.n = b[0].buf; e.c = b[1].buf; e.at = b[2].buf; e.rank_cost = b[3].buf; e.free = b[4].buf;
    e.samples = samples; e.ranks = ranks; e.per_rank = per_rank; e.cap = cap; e.pair_from = pair_from;
    for (Py_ssize_t i = 0; i < samples; i++)
        if (e.at[i] < 0 || e.at[i] >= ranks * per_rank || e.n[i] <= 0) {
            PyErr_SetString(PyExc_ValueError, "exchange: a sample's row or length is out of range");
            goto fail;
        }
    e.head = malloc((size_t)ranks * sizeof(int64_t));
    e.next = malloc((size_t)(samples + 1) * sizeof(int64_t));
    e.prev = malloc((size_t)(samples + 1) * sizeof(int64_t));
    e.mine = malloc((size_t)(samples + 1) * sizeof(int64_t));
    e.buckets = calloc(4 * ((size_t)cap + 1), sizeof(Bucket));
    for (e.leaves = 1; e.leaves < cap + 1; e.leaves *= 2) {}
    for (int t = 0; t < 2; t++) {
        e.cheapest[t] = malloc(2 * (size_t)e.leaves * sizeof(double));
        if (e.cheapest[t]) for (Py_ssize_t i = 0; i < 2 * e.leaves; i++) e.cheapest[t][i] = HUGE_VAL;
    }
    e.listed = malloc(((size_t)samples + 64 * 63 / 2) * sizeof(Offer));
    e.listed_at = malloc(((size_t)samples + 64 * 63 / 2) * sizeof(int64_t));
    if (!e.head || !e.next || !e.prev || !e.mine || !e.buckets || !e.listed || !e.listed_at || !e.cheapest[0]
        || !e.cheapest[1]) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t r = 0; r < ranks; r++) e.head[r] = -1;
    for (Py_ssize_t i = samples - 1; i >= 0; i--) link_sample(&e, i, e.at[i] / per_rank);
    for (Py_ssize_t r = 0; r < ranks; r++) if (add_offers(&e, r) < 0) { PyErr_NoMemory(); goto fail; }
    Py_ssize_t rounds;
    Py_BEGIN_ALLOW_THREADS
    rounds = run(&e, level, max_rounds);
    Py_END_ALLOW_THREADS
    if (rounds < 0) { PyErr_NoMemory(); goto fail; }
    result = PyLong_FromSsize_t(rounds);
fail:
    if (e.buckets) for (Py_ssize_t g = 0; g < 4 * (cap + 1); g++) free(e.buckets[g].a);
    free(e.buckets); free(e.listed); free(e.listed_at); free(e.cheapest[0]); free(e.cheapest[1]);
    free(e.mine); free(e.head); free(e.next); free(e.prev);
    for (int i = 0; i < held; i++) PyBuffer_Release(&b[i]);
    return result;
}

PyDoc_STRVAR(place_doc,
"place(n, c, order, budget, free, rank_cost, per_rank, out_row) -> tokens placed\n\n"
"Places whole samples by the rule of coordinator.balance._place_whole: out_row[k] is the row of\n"
"sample order[k], or -1 where it is left out; in place on free and rank_cost.");

static PyObject *place(PyObject *self, PyObject *args) {
    PyObject *o_n, *o_c, *o_order, *o_free, *o_cost, *o_out;
    Py_ssize_t per_rank;
    long long budget;
    if (!PyArg_ParseTuple(args, "OOOLOOnO", &o_n, &o_c, &o_order, &budget, &o_free, &o_cost, &per_rank, &o_out))
        return NULL;
    if (per_rank <= 0) { PyErr_SetString(PyExc_ValueError, "place: per_rank must be positive"); return NULL; }
    Py_buffer b[6];
    int held = 0;
    PyObject *result = NULL;
    Py_ssize_t samples = get(o_n, &b[0], -1, 0, "n"), count, ranks;
    if (samples < 0) return NULL;
    held = 1;
    if (get(o_c, &b[1], samples, 0, "c") < 0) goto fail;
    held = 2;
    if ((count = get(o_order, &b[2], -1, 0, "order")) < 0) goto fail;
    held = 3;
    if ((ranks = get(o_cost, &b[3], -1, 1, "rank_cost")) < 0) goto fail;
    held = 4;
    if (get(o_free, &b[4], ranks * per_rank, 1, "free") < 0) goto fail;
    held = 5;
    if (get(o_out, &b[5], count, 1, "out_row") < 0) goto fail;
    held = 6;
    const int64_t *n = b[0].buf, *order = b[2].buf;
    const double *c = b[1].buf;
    double *rank_cost = b[3].buf;
    int64_t *free_ = b[4].buf, *out = b[5].buf;
    for (Py_ssize_t k = 0; k < count; k++)
        if (order[k] < 0 || order[k] >= samples) {
            PyErr_SetString(PyExc_ValueError, "place: order out of range");
            goto fail;
        }
    long long placed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < count; k++) {
        int64_t i = order[k], len = n[i];
        out[k] = -1;
        if (placed + len > budget) continue;
        Py_ssize_t best = -1;
        for (Py_ssize_t r = 0; r < ranks; r++) {
            if (best >= 0 && !(rank_cost[r] < rank_cost[best])) continue;
            const int64_t *f = free_ + r * per_rank;
            for (Py_ssize_t j = 0; j < per_rank; j++)
                if (f[j] >= len) { best = r; break; }
        }
        if (best < 0) continue;
        int64_t *f = free_ + best * per_rank;
        Py_ssize_t row = -1;
        for (Py_ssize_t j = 0; j < per_rank; j++)
            if (f[j] >= len && (row < 0 || f[j] < f[row])) row = j;
        f[row] -= len;
        placed += len;
        rank_cost[best] += c[i];
        out[k] = best * per_rank + row;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong(placed);
fail:
    for (int i = 0; i < held; i++) PyBuffer_Release(&b[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"place", place, METH_VARARGS, place_doc},
    {"exchange", exchange, METH_VARARGS, exchange_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "coordinator._whole",
    "The layout of whole samples of coordinator.balance, compiled.", -1, methods,
};

PyMODINIT_FUNC PyInit__whole(void) { return PyModule_Create(&module); }
