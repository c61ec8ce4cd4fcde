/* Whole-block float32 passes of a lossy ring hop, one pass over the chunk each, GIL released.
 *
 * combine(src, land, packed, out, starts, lens, received, packed_at, sums): for every block b (elements
 * starts[b] .. starts[b] + lens[b]):
 *     packed_at[b] >= 0:  out = src + packed[packed_at[b] ...]   (an important block, from the stream lane)
 *     received[b] != 0:   out = src + land                       (an unimportant block that came in time)
 *     otherwise:          out = src                              (lost or kept back: the input alone)
 * and sums[b] = sum of |out| over the block (float32), the next hop's block scores.
 *
 * split(x, res_in, packed, res_out, data, starts, lens, kind, packed_at, live): the sending end of the hop. For every
 * block b, y = x + res_in (res_in empty: y = x), then by kind[b]:
 *     0 (important):  packed[packed_at[b] ...] = y   (the stream lane's message)
 *     1 (kept back):  res_out = y                     (the send budget kept it: error feedback carries it)
 *     2 (sent):       data = y                        (the round's datagrams read it there)
 * and res_out (when not empty) is zero on the blocks of kind 0 and 2. res_out may be res_in (in place).
 * live (optional, a byte per block, only with res_out the same buffer as res_in): live[b] == 0 says the residual's
 * block b is zero already, so it is neither read (y = x) nor zeroed again; afterwards live[b] = (kind[b] == 1), which
 * the pass has made true. Without it every block of res_in is read and every block of res_out written.
 *
 * abs_sums(x, starts, lens, sums): sums[b] = sum of |x| over block b (float32): the codec's block scores of a chunk no
 * combine pass has summed (a hop's first chunk).
 *
 * Each takes an optional last argument, threads (default 1): the blocks are cut into that many contiguous ranges, one
 * per thread (POSIX threads; the calling thread runs the first), after every bound has been checked. Blocks never
 * share an output element, a packed slot or a sum, so the ranges need no locking. A thread that cannot be started
 * has its range run by the calling thread.
 *
 * Every bound is checked before anything is written. The pure-Python twins (torch) are
 * dgt.protocol.block_ops.combine_blocks_torch and split_blocks_torch; tests check the twins agree.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifndef _WIN32
#include <pthread.h>
#endif

#define MAX_THREADS 16

typedef void (*range_fn)(const void *ctx, Py_ssize_t b0, Py_ssize_t b1);
typedef struct {
    range_fn fn;
    const void *ctx;
    Py_ssize_t b0, b1;
} Range;

static void *run_range(void *p) {
    const Range *r = p;
    r->fn(r->ctx, r->b0, r->b1);
    return NULL;
}

/* fn over blocks [0, nb) in `threads` contiguous ranges (called with the GIL released). */
static void for_blocks(range_fn fn, const void *ctx, Py_ssize_t nb, int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > nb) threads = (int)nb;
    if (threads <= 1) {
        fn(ctx, 0, nb);
        return;
    }
    Range r[MAX_THREADS];
    for (int t = 0; t < threads; t++) r[t] = (Range){fn, ctx, nb * t / threads, nb * (t + 1) / threads};
#ifndef _WIN32
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tid[t], NULL, run_range, &r[t]) == 0;
    run_range(&r[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else run_range(&r[t]);
    }
#else
    for (int t = 0; t < threads; t++) run_range(&r[t]);
#endif
}

static float add_abs(float *o, const float *a, const float *b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) {
            float v = a[i + k] + b[i + k];
            o[i + k] = v;
            acc[k] += fabsf(v);
        }
    for (; i < n; i++) {
        float v = a[i] + b[i];
        o[i] = v;
        acc[0] += fabsf(v);
    }
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static float abs_sum(const float *a, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += fabsf(a[i + k]);
    for (; i < n; i++) acc[0] += fabsf(a[i]);
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static float copy_abs(float *o, const float *a, int64_t n) {
    if (o != a) memcpy(o, a, (size_t)n * sizeof(float));
    return abs_sum(a, n);
}

typedef struct {
    const float *s, *l, *p;
    float *o, *sums;
    const int64_t *S, *L, *P;
    const unsigned char *R;
} CombineCtx;

static void combine_range(const void *ctx, Py_ssize_t b0, Py_ssize_t b1) {
    const CombineCtx *c = ctx;
    for (Py_ssize_t b = b0; b < b1; b++) {
        int64_t a = c->S[b], k = c->L[b];
        if (c->P[b] >= 0) c->sums[b] = add_abs(c->o + a, c->s + a, c->p + c->P[b], k);
        else if (c->R[b]) c->sums[b] = add_abs(c->o + a, c->s + a, c->l + a, k);
        else c->sums[b] = copy_abs(c->o + a, c->s + a, k);
    }
}

static PyObject *combine(PyObject *self, PyObject *args) {
    Py_buffer src, land, packed, out, st, ln, rc, pa, sm;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "y*y*y*w*y*y*y*y*w*|i", &src, &land, &packed, &out, &st, &ln, &rc, &pa, &sm,
                          &threads))
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = src.len / 4, nb = st.len / 8, np_ = packed.len / 4;
    const int64_t *S = st.buf, *L = ln.buf, *P = pa.buf;
    const unsigned char *R = rc.buf;
    const char *why = NULL;
    if (src.len % 4 || land.len != src.len || out.len != src.len || packed.len % 4)
        why = "combine: src, land and out are float32 of one size, packed float32";
    else if (ln.len != st.len || pa.len != st.len || rc.len != nb || sm.len != nb * 4)
        why = "combine: starts, lens, packed_at (int64), received (bytes) and sums (float32) need one entry per block";
    for (Py_ssize_t b = 0; b < nb && !why; b++) {
        if (S[b] < 0 || L[b] < 0 || S[b] > n - L[b]) why = "combine: a block lies outside the chunk";
        else if (P[b] >= 0 && P[b] > np_ - L[b]) why = "combine: an important block lies outside the packed blocks";
    }
    if (why) {
        PyErr_SetString(PyExc_ValueError, why);
    } else {
        CombineCtx c = {src.buf, land.buf, packed.buf, out.buf, sm.buf, S, L, P, R};
        Py_BEGIN_ALLOW_THREADS
        for_blocks(combine_range, &c, nb, threads);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        res = Py_None;
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&land);
    PyBuffer_Release(&packed);
    PyBuffer_Release(&out);
    PyBuffer_Release(&st);
    PyBuffer_Release(&ln);
    PyBuffer_Release(&rc);
    PyBuffer_Release(&pa);
    PyBuffer_Release(&sm);
    return res;
}

static void put(float *o, const float *a, const float *r, int64_t n) {
    if (r)
        for (int64_t i = 0; i < n; i++) o[i] = a[i] + r[i];
    else if (o != a)
        memcpy(o, a, (size_t)n * sizeof(float));
}

typedef struct {
    const float *a, *r;
    float *p, *o, *d;
    const int64_t *S, *L, *P;
    const unsigned char *K;
    unsigned char *live;
} SplitCtx;

static void split_range(const void *ctx, Py_ssize_t b0, Py_ssize_t b1) {
    const SplitCtx *c = ctx;
    for (Py_ssize_t b = b0; b < b1; b++) {
        int64_t s0 = c->S[b], k = c->L[b];
        int lv = !c->live || c->live[b];  /* the residual's block may be nonzero */
        const float *rb = c->r && lv ? c->r + s0 : NULL;
        if (c->K[b] == 0) put(c->p + c->P[b], c->a + s0, rb, k);
        else if (c->K[b] == 1) put(c->o + s0, c->a + s0, rb, k);
        else put(c->d + s0, c->a + s0, rb, k);
        if (c->o && c->K[b] != 1 && lv) memset(c->o + s0, 0, (size_t)k * sizeof(float));
        if (c->live) c->live[b] = c->K[b] == 1;
    }
}

static PyObject *split(PyObject *self, PyObject *args) {
    Py_buffer x, ri, packed, ro, data, st, ln, kd, pa, lv;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "y*y*w*w*w*y*y*y*y*w*|i", &x, &ri, &packed, &ro, &data, &st, &ln, &kd, &pa, &lv,
                          &threads))
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = x.len / 4, nb = st.len / 8, np_ = packed.len / 4;
    const int64_t *S = st.buf, *L = ln.buf, *P = pa.buf;
    const unsigned char *K = kd.buf;
    const char *why = NULL;
    if (x.len % 4 || data.len != x.len || packed.len % 4 || (ri.len && ri.len != x.len) || (ro.len && ro.len != x.len))
        why = "split: x, data (and res_in, res_out when given) are float32 of one size, packed float32";
    else if (ln.len != st.len || pa.len != st.len || kd.len != nb)
        why = "split: starts, lens, packed_at (int64) and kind (bytes) need one entry per block";
    else if (lv.len && (lv.len != nb || !ro.len || ri.buf != ro.buf))
        why = "split: live flags need one byte per block and res_out the same buffer as res_in";
    for (Py_ssize_t b = 0; b < nb && !why; b++) {
        if (S[b] < 0 || L[b] < 0 || S[b] > n - L[b]) why = "split: a block lies outside the bucket";
        else if (K[b] > 2) why = "split: a block's kind is not 0, 1 or 2";
        else if (K[b] == 0 && (P[b] < 0 || P[b] > np_ - L[b])) why = "split: an important block lies outside packed";
        else if (K[b] == 1 && !ro.len) why = "split: a kept-back block needs res_out";
    }
    if (why) {
        PyErr_SetString(PyExc_ValueError, why);
    } else {
        SplitCtx c = {x.buf, ri.len ? (const float *)ri.buf : NULL, packed.buf, ro.len ? (float *)ro.buf : NULL,
                      data.buf, S, L, P, K, lv.len ? (unsigned char *)lv.buf : NULL};
        Py_BEGIN_ALLOW_THREADS
        for_blocks(split_range, &c, nb, threads);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        res = Py_None;
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&ri);
    PyBuffer_Release(&packed);
    PyBuffer_Release(&ro);
    PyBuffer_Release(&data);
    PyBuffer_Release(&st);
    PyBuffer_Release(&ln);
    PyBuffer_Release(&kd);
    PyBuffer_Release(&pa);
    PyBuffer_Release(&lv);
    return res;
}

typedef struct {
    const float *a;
    float *sums;
    const int64_t *S, *L;
} AbsCtx;

static void abs_range(const void *ctx, Py_ssize_t b0, Py_ssize_t b1) {
    const AbsCtx *c = ctx;
    for (Py_ssize_t b = b0; b < b1; b++) c->sums[b] = abs_sum(c->a + c->S[b], c->L[b]);
}

static PyObject *abs_sums(PyObject *self, PyObject *args) {
    Py_buffer x, st, ln, sm;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "y*y*y*w*|i", &x, &st, &ln, &sm, &threads)) return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = x.len / 4, nb = st.len / 8;
    const int64_t *S = st.buf, *L = ln.buf;
    const char *why = NULL;
    if (x.len % 4 || ln.len != st.len || sm.len != nb * 4)
        why = "abs_sums: x float32, starts and lens (int64) and sums (float32) one entry per block";
    for (Py_ssize_t b = 0; b < nb && !why; b++)
        if (S[b] < 0 || L[b] < 0 || S[b] > n - L[b]) why = "abs_sums: a block lies outside x";
    if (why) {
        PyErr_SetString(PyExc_ValueError, why);
    } else {
        AbsCtx c = {x.buf, sm.buf, S, L};
        Py_BEGIN_ALLOW_THREADS
        for_blocks(abs_range, &c, nb, threads);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        res = Py_None;
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&st);
    PyBuffer_Release(&ln);
    PyBuffer_Release(&sm);
    return res;
}

static PyMethodDef methods[] = {
    {"abs_sums", abs_sums, METH_VARARGS, "abs_sums(x, starts, lens, sums[, threads]): sum of |x| per block (float32)"},
    {"split", split, METH_VARARGS,
     "split(x, res_in, packed, res_out, data, starts, lens, kind, packed_at, live[, threads]): a lossy hop's send side per "
     "block "
     "(see dgt/protocol/block_ops.py)"},
    {"combine", combine, METH_VARARGS,
     "combine(src, land, packed, out, starts, lens, received, packed_at, sums[, threads]): a lossy ring hop's sum per "
     "block "
     "(see dgt/protocol/block_ops.py)"},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockops", "Whole-block float32 passes of a lossy hop.",
                                    -1, methods};
PyMODINIT_FUNC PyInit__blockops(void) { return PyModule_Create(&module); }
