/* Whole-block float32 passes of a lossy ring hop, one pass over the chunk each, GIL released.
 *
 * combine(src, land, packed, out, starts, lens, received, packed_at, sums): for every block b (elements
 * starts[b] .. starts[b] + lens[b]):
 *     packed_at[b] >= 0:  out = src + packed[packed_at[b] ...]   (an important block, from the stream lane)
 *     received[b] != 0:   out = src + land                       (an unimportant block that came in time)
 *     otherwise:          out = src                              (lost or kept back: the input alone)
 * and sums[b] = sum of |out| over the block (float32), the next hop's block scores.
 *
 * split(x, res_in, packed, res_out, data, starts, lens, kind, packed_at): the sending end of the hop. For every
 * block b, y = x + res_in (res_in empty: y = x), then by kind[b]:
 *     0 (important):  packed[packed_at[b] ...] = y   (the stream lane's message)
 *     1 (kept back):  res_out = y                     (the send budget kept it: error feedback carries it)
 *     2 (sent):       data = y                        (the round's datagrams read it there)
 * and res_out (when not empty) is zero on the blocks of kind 0 and 2. res_out may be res_in (in place).
 *
 * abs_sums(x, starts, lens, sums): sums[b] = sum of |x| over block b (float32): the codec's block scores of a chunk no
 * combine pass has summed (a hop's first chunk).
 *
 * Every bound is checked before anything is written. The pure-Python twins (torch) are
 * dgt.protocol.block_ops.combine_blocks_torch and split_blocks_torch; tests check the twins agree.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

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

static PyObject *combine(PyObject *self, PyObject *args) {
    Py_buffer src, land, packed, out, st, ln, rc, pa, sm;
    if (!PyArg_ParseTuple(args, "y*y*y*w*y*y*y*y*w*", &src, &land, &packed, &out, &st, &ln, &rc, &pa, &sm))
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
        const float *s = src.buf, *l = land.buf, *p = packed.buf;
        float *o = out.buf, *sums = sm.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t b = 0; b < nb; b++) {
            int64_t a = S[b], k = L[b];
            if (P[b] >= 0) sums[b] = add_abs(o + a, s + a, p + P[b], k);
            else if (R[b]) sums[b] = add_abs(o + a, s + a, l + a, k);
            else sums[b] = copy_abs(o + a, s + a, k);
        }
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

static PyObject *split(PyObject *self, PyObject *args) {
    Py_buffer x, ri, packed, ro, data, st, ln, kd, pa;
    if (!PyArg_ParseTuple(args, "y*y*w*w*w*y*y*y*y*", &x, &ri, &packed, &ro, &data, &st, &ln, &kd, &pa)) return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = x.len / 4, nb = st.len / 8, np_ = packed.len / 4;
    const int64_t *S = st.buf, *L = ln.buf, *P = pa.buf;
    const unsigned char *K = kd.buf;
    const char *why = NULL;
    if (x.len % 4 || data.len != x.len || packed.len % 4 || (ri.len && ri.len != x.len) || (ro.len && ro.len != x.len))
        why = "split: x, data (and res_in, res_out when given) are float32 of one size, packed float32";
    else if (ln.len != st.len || pa.len != st.len || kd.len != nb)
        why = "split: starts, lens, packed_at (int64) and kind (bytes) need one entry per block";
    for (Py_ssize_t b = 0; b < nb && !why; b++) {
        if (S[b] < 0 || L[b] < 0 || S[b] > n - L[b]) why = "split: a block lies outside the bucket";
        else if (K[b] > 2) why = "split: a block's kind is not 0, 1 or 2";
        else if (K[b] == 0 && (P[b] < 0 || P[b] > np_ - L[b])) why = "split: an important block lies outside packed";
        else if (K[b] == 1 && !ro.len) why = "split: a kept-back block needs res_out";
    }
    if (why) {
        PyErr_SetString(PyExc_ValueError, why);
    } else {
        const float *a = x.buf, *r = ri.len ? (const float *)ri.buf : NULL;
        float *p = packed.buf, *o = ro.len ? (float *)ro.buf : NULL, *d = data.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t b = 0; b < nb; b++) {
            int64_t s0 = S[b], k = L[b];
            const float *rb = r ? r + s0 : NULL;
            if (K[b] == 0) put(p + P[b], a + s0, rb, k);
            else if (K[b] == 1) put(o + s0, a + s0, rb, k);
            else put(d + s0, a + s0, rb, k);
            if (o && K[b] != 1) memset(o + s0, 0, (size_t)k * sizeof(float));
        }
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
    return res;
}

static PyObject *abs_sums(PyObject *self, PyObject *args) {
    Py_buffer x, st, ln, sm;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &x, &st, &ln, &sm)) return NULL;
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
        const float *a = x.buf;
        float *sums = sm.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t b = 0; b < nb; b++) sums[b] = abs_sum(a + S[b], L[b]);
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
    {"abs_sums", abs_sums, METH_VARARGS, "abs_sums(x, starts, lens, sums): sum of |x| per block (float32)"},
    {"split", split, METH_VARARGS,
     "split(x, res_in, packed, res_out, data, starts, lens, kind, packed_at): a lossy hop's send side per block "
     "(see dgt/protocol/block_ops.py)"},
    {"combine", combine, METH_VARARGS,
     "combine(src, land, packed, out, starts, lens, received, packed_at, sums): a lossy ring hop's sum per block "
     "(see dgt/protocol/block_ops.py)"},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockops", "Whole-block float32 passes of a lossy hop.",
                                    -1, methods};
PyMODINIT_FUNC PyInit__blockops(void) { return PyModule_Create(&module); }
