/* NH universal hash (UMAC's first layer, Black et al. CRYPTO '99) over many equal-length byte rows, GIL released.
 *
 * nh(data, starts, nbytes, key, out): for every i, out[i] = sum over j of
 *     ((w[2j] + key[2j]) mod 2^32) * ((w[2j+1] + key[2j+1]) mod 2^32)   mod 2^64
 * where w are the little-endian 32-bit words of data[starts[i] : starts[i] + nbytes] zero-padded to a multiple of
 * 8 bytes. The pure-Python twin (numpy) is dgt.protocol.datagram_mac.nh_rows_numpy; tests check both agree.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t le32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static uint64_t nh_one(const unsigned char *p, size_t n, const uint32_t *k) {
    uint64_t acc = 0;
    size_t pairs = n / 8;
    for (size_t i = 0; i < pairs; i++) {
        uint32_t a = le32(p + 8 * i) + k[2 * i];
        uint32_t b = le32(p + 8 * i + 4) + k[2 * i + 1];
        acc += (uint64_t)a * (uint64_t)b;
    }
    if (n % 8) {
        unsigned char t[8] = {0};
        memcpy(t, p + 8 * pairs, n % 8);
        uint32_t a = le32(t) + k[2 * pairs];
        uint32_t b = le32(t + 4) + k[2 * pairs + 1];
        acc += (uint64_t)a * (uint64_t)b;
    }
    return acc;
}

static PyObject *nh(PyObject *self, PyObject *args) {
    Py_buffer data, starts, key, out;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "y*y*ny*w*", &data, &starts, &nbytes, &key, &out)) return NULL;
    PyObject *res = NULL;
    Py_ssize_t rows = starts.len / 8;
    Py_ssize_t words = 2 * ((nbytes + 7) / 8);
    if (nbytes < 0 || starts.len % 8 || out.len < rows * 8 || key.len < words * 4) {
        PyErr_SetString(PyExc_ValueError, "nh: starts must be int64, out uint64 per start, key >= the padded length");
        goto done;
    }
    const int64_t *st = (const int64_t *)starts.buf;
    for (Py_ssize_t i = 0; i < rows; i++) {
        if (st[i] < 0 || st[i] + nbytes > data.len) {
            PyErr_SetString(PyExc_ValueError, "nh: a row reaches outside the data");
            goto done;
        }
    }
    {
        const unsigned char *d = (const unsigned char *)data.buf;
        const uint32_t *k = (const uint32_t *)key.buf;
        uint64_t *o = (uint64_t *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < rows; i++) o[i] = nh_one(d + st[i], (size_t)nbytes, k);
        Py_END_ALLOW_THREADS
    }
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&key);
    PyBuffer_Release(&out);
    return res;
}

static PyMethodDef methods[] = {
    {"nh", nh, METH_VARARGS,
     "nh(data, starts_int64, nbytes, key_uint32, out_uint64): NH of each row data[s : s + nbytes] (zero-padded to "
     "8 bytes) into out"},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nh", "NH universal hash over byte rows.", -1, methods};
PyMODINIT_FUNC PyInit__nh(void) { return PyModule_Create(&module); }
