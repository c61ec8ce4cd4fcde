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

/* Whether every row [starts[i], starts[i] + span) lies inside a buffer of len bytes; else sets ValueError(msg). */
static int rows_inside(const int64_t *st, Py_ssize_t rows, Py_ssize_t span, Py_ssize_t len, const char *msg) {
    for (Py_ssize_t i = 0; i < rows; i++) {
        if (st[i] < 0 || st[i] + span > len) {
            PyErr_SetString(PyExc_ValueError, msg);
            return 0;
        }
    }
    return 1;
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
    if (!rows_inside(st, rows, nbytes, data.len, "nh: a row reaches outside the data")) goto done;
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

static inline void put_le64(unsigned char *p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

static inline uint64_t get_le64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* tags(buf, starts, nbytes, key, add, pads, write): per row i the tag NH(buf[s : s + nbytes]) + add + pads[i]
 * (mod 2^64), with s = starts[i]; write: store it little-endian at buf[s + nbytes] (buf writable) and return None;
 * else compare it with the 8 bytes stored there and return bytes of 0/1 per row. */
static PyObject *tags(PyObject *self, PyObject *args) {
    Py_buffer data, starts, key, pads;
    Py_ssize_t nbytes;
    unsigned long long add;
    int write;
    if (!PyArg_ParseTuple(args, "y*y*ny*Ky*p", &data, &starts, &nbytes, &key, &add, &pads, &write)) return NULL;
    PyObject *res = NULL;
    if (write && data.readonly) {
        PyErr_SetString(PyExc_ValueError, "tags: the buffer to write tags into is read-only");
        goto done;
    }
    Py_ssize_t rows = starts.len / 8;
    Py_ssize_t words = 2 * ((nbytes + 7) / 8);
    if (nbytes < 0 || starts.len % 8 || pads.len < rows * 8 || key.len < words * 4) {
        PyErr_SetString(PyExc_ValueError, "tags: starts int64, a uint64 pad per start, key >= the padded length");
        goto done;
    }
    const int64_t *st = (const int64_t *)starts.buf;
    if (!rows_inside(st, rows, nbytes + 8, data.len, "tags: a row (with its tag) reaches outside the data")) goto done;
    PyObject *okobj = NULL;
    unsigned char *ok = NULL;
    if (!write) {
        okobj = PyBytes_FromStringAndSize(NULL, rows);
        if (okobj == NULL) goto done;
        ok = (unsigned char *)PyBytes_AS_STRING(okobj);
    }
    {
        unsigned char *d = (unsigned char *)data.buf;
        const uint32_t *k = (const uint32_t *)key.buf;
        const uint64_t *pd = (const uint64_t *)pads.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < rows; i++) {
            uint64_t t = nh_one(d + st[i], (size_t)nbytes, k) + (uint64_t)add + pd[i];
            if (write)
                put_le64(d + st[i] + nbytes, t);
            else
                ok[i] = get_le64(d + st[i] + nbytes) == t;
        }
        Py_END_ALLOW_THREADS
    }
    if (write) {
        res = Py_None;
        Py_INCREF(res);
    } else {
        res = okobj;
    }
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&key);
    PyBuffer_Release(&pads);
    return res;
}

static PyMethodDef methods[] = {
    {"tags", tags, METH_VARARGS,
     "tags(buf, starts_int64, nbytes, key_uint32, add, pads_uint64, write): MAC tags of rows buf[s : s + nbytes] "
     "written after each row (write) or checked against what is there (bytes of 0/1)"},
    {"nh", nh, METH_VARARGS,
     "nh(data, starts_int64, nbytes, key_uint32, out_uint64): NH of each row data[s : s + nbytes] (zero-padded to "
     "8 bytes) into out"},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nh", "NH universal hash over byte rows.", -1, methods};
PyMODINIT_FUNC PyInit__nh(void) { return PyModule_Create(&module); }
