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

static inline uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

static inline uint64_t be64(const unsigned char *p) { return ((uint64_t)be32(p) << 32) | be32(p + 4); }

/* Header field offsets (dgt.wire.HEADER_DTYPE, checked at import by dgt.protocol.fused_landing). */
enum { H_FLAGS = 4, H_DTYPE = 5, H_BLOCK = 28, H_OFFSET = 32, H_COUNT = 40, H_LENGTH = 44, H_SIZE = 48 };

typedef struct {
    const unsigned char *hdr, *src;
    const int64_t *pos, *bstart, *bend, *fneed;
    Py_ssize_t n, srclen, rawlen, got_len, nblocks, fpb;
    unsigned flag_important, flag_mac;
    int64_t frag, isz, dtype;
    unsigned char *raw, *got, *imp;
    int8_t *lane_of;
    int64_t *nfrag;
    int32_t *scratch;
    int8_t lane;
    const uint32_t *key;
    const uint64_t *tail, *pads;
    Py_ssize_t keywords, tailn, npads;
} Land;

/* Geometry of datagram i: 1 and its block, fragment index, offset, count if it fits its round, else 0 (as
 * dgt.protocol.landing.land_fragments_numpy's `good`). */
static int geometry(const Land *L, Py_ssize_t i, int64_t *b, int64_t *fidx, int64_t *off, int64_t *cnt) {
    const unsigned char *h = L->hdr + H_SIZE * i;
    int64_t blk = be32(h + H_BLOCK);
    *off = (int64_t)be64(h + H_OFFSET);
    *cnt = be32(h + H_COUNT);
    if (blk >= L->nblocks || h[H_DTYPE] != L->dtype) return 0;
    int64_t rel = *off - L->bstart[blk];
    if (rel < 0 || rel % L->frag) return 0;
    *b = blk;
    *fidx = rel / L->frag;
    int64_t room = L->bend[blk] - *off;
    return *fidx < L->fneed[blk] && *cnt == (L->frag < room ? L->frag : room);
}

/* Whether datagram i (header at src[pos - 48], payload, 8-byte tag) carries Flags.MAC and a right tag. */
static int mac_ok(const Land *L, Py_ssize_t i, int64_t slot, int64_t cnt) {
    if (!(L->hdr[H_SIZE * i + H_FLAGS] & L->flag_mac)) return 0;
    int64_t nbytes = H_SIZE + cnt * L->isz;
    const unsigned char *p = L->src + L->pos[i] - H_SIZE;
    uint64_t t = nh_one(p, (size_t)nbytes, L->key) + L->tail[(nbytes + 7) / 8] + L->pads[slot];
    return get_le64(p + nbytes) == t;
}

/* The landing loop (GIL released): the batch in reverse order, so that of several copies of one fragment the last
 * lands (as the numpy twin's first_of keeps the last); res: rejected, bad_mac, duplicated, kept, kept_bytes,
 * done delta, important-done delta. touched/before: n entries each. */
static void land_loop(Land *L, int64_t *res, int64_t *touched, unsigned char *before) {
    Py_ssize_t nt = 0;
    for (Py_ssize_t i = L->n - 1; i >= 0; i--) {
        int64_t b, fidx, off, cnt;
        if (!geometry(L, i, &b, &fidx, &off, &cnt)) { res[0]++; continue; }
        int64_t slot = b * L->fpb + fidx;
        if (L->key && !mac_ok(L, i, slot, cnt)) { res[1]++; continue; }
        res[3]++;
        res[4] += H_SIZE + be32(L->hdr + H_SIZE * i + H_LENGTH);
        if (L->got[slot]) { res[2]++; continue; }
        int32_t t = L->scratch[b];
        if (!(t >= 0 && t < nt && touched[t] == b)) {  /* first fresh fragment of block b in this batch */
            L->scratch[b] = (int32_t)nt;
            touched[nt] = b;
            before[nt] = (unsigned char)((L->nfrag[b] >= L->fneed[b]) | (L->imp[b] ? 2 : 0));
            nt++;
            L->imp[b] = L->imp[b] || (L->hdr[H_SIZE * i + H_FLAGS] & L->flag_important);
        }
        memcpy(L->raw + off * L->isz, L->src + L->pos[i], (size_t)(cnt * L->isz));
        L->got[slot] = 1;
        L->nfrag[b]++;
        L->lane_of[b] = L->lane;
    }
    for (Py_ssize_t j = 0; j < nt; j++) {
        int64_t b = touched[j];
        int done = L->nfrag[b] >= L->fneed[b], was = before[j] & 1;
        res[5] += done - was;
        res[6] += (done && L->imp[b]) - (was && (before[j] & 2));
    }
}

/* Bounds of every datagram that fits the geometry: its payload (and tag) inside src, inside raw, its pad. */
static int land_bounds(const Land *L) {
    for (Py_ssize_t i = 0; i < L->n; i++) {
        int64_t b, fidx, off, cnt;
        if (!geometry(L, i, &b, &fidx, &off, &cnt)) continue;
        int64_t nb = cnt * L->isz, p = L->pos[i];
        int tagged = L->key && (L->hdr[H_SIZE * i + H_FLAGS] & L->flag_mac);  /* else refused unread */
        int64_t lo = tagged ? p - H_SIZE : p, hi = p + nb + (tagged ? 8 : 0);
        if (lo < 0 || hi > L->srclen || off * L->isz + nb > L->rawlen || b * L->fpb + fidx >= L->got_len) return 0;
        if (L->key && (b * L->fpb + fidx >= L->npads || 2 * ((H_SIZE + nb + 7) / 8) > L->keywords ||
                       (H_SIZE + nb + 7) / 8 >= L->tailn)) return 0;
    }
    return 1;
}

#define LAND_BUFS 12
/* land(hdr, pos, src, raw, got, nfrag, important, lane_of, scratch, block_start, block_end, frags_needed,
 *      nblocks, frags_per_block, frag, itemsize, dtype, lane, flag_important, flag_mac, mac, key, tail, pads):
 * the fragments of one round's batch validated against its geometry, MAC-checked (mac), de-duplicated, copied
 * into raw and marked, in one pass; returns (rejected, bad_mac, duplicated, kept, kept_bytes, done delta,
 * important-done delta). The numpy twin is dgt.protocol.landing.land_fragments_numpy. */
static PyObject *land(PyObject *self, PyObject *args) {
    Py_buffer v[LAND_BUFS + 3];
    memset(v, 0, sizeof v);
    Py_ssize_t nblocks, fpb;
    long long frag, isz, dtype;
    int lane, fimp, fmac, mac;
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*w*w*w*w*y*y*y*nnLLLiiipy*y*y*", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                          &v[6], &v[7], &v[8], &v[9], &v[10], &v[11], &nblocks, &fpb, &frag, &isz, &dtype, &lane,
                          &fimp, &fmac, &mac, &v[12], &v[13], &v[14]))
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = v[1].len / 8;
    if (v[1].len % 8 || v[0].len != n * H_SIZE || nblocks < 0 || fpb < 1 || frag < 1 || isz < 1 ||
        v[5].len < nblocks * 8 || v[6].len < nblocks || v[7].len < nblocks || v[8].len < nblocks * 4 ||
        v[9].len < nblocks * 8 || v[10].len < nblocks * 8 || v[11].len < nblocks * 8) {
        PyErr_SetString(PyExc_ValueError, "land: headers [n, 48], int64 positions, per-block arrays of nblocks");
        goto done;
    }
    Land L = {(const unsigned char *)v[0].buf, (const unsigned char *)v[2].buf, (const int64_t *)v[1].buf,
              (const int64_t *)v[9].buf, (const int64_t *)v[10].buf, (const int64_t *)v[11].buf,
              n, v[2].len, v[3].len, v[4].len, nblocks, fpb, (unsigned)fimp, (unsigned)fmac, frag, isz, dtype,
              (unsigned char *)v[3].buf, (unsigned char *)v[4].buf, (unsigned char *)v[6].buf, (int8_t *)v[7].buf,
              (int64_t *)v[5].buf, (int32_t *)v[8].buf, (int8_t)lane,
              mac ? (const uint32_t *)v[12].buf : NULL, (const uint64_t *)v[13].buf, (const uint64_t *)v[14].buf,
              v[12].len / 4, v[13].len / 8, v[14].len / 8};
    if (!land_bounds(&L)) {
        PyErr_SetString(PyExc_ValueError, "land: a datagram reaches outside its buffer, the round or the MAC tables");
        goto done;
    }
    int64_t r[7] = {0};
    int64_t *touched = PyMem_Malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    unsigned char *before = PyMem_Malloc((size_t)(n ? n : 1));
    if (!touched || !before) {
        PyMem_Free(touched);
        PyMem_Free(before);
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    land_loop(&L, r, touched, before);
    Py_END_ALLOW_THREADS
    PyMem_Free(touched);
    PyMem_Free(before);
    res = Py_BuildValue("(LLLLLLL)", (long long)r[0], (long long)r[1], (long long)r[2], (long long)r[3],
                        (long long)r[4], (long long)r[5], (long long)r[6]);
done:
    for (int i = 0; i < LAND_BUFS + 3; i++)
        if (v[i].obj) PyBuffer_Release(&v[i]);
    return res;
}

/* Reason codes as dgt.wire.REASONS. */
enum { R_MAGIC = 1, R_VERSION, R_FTYPE, R_DTYPE, R_LENGTH, R_COUNT, R_TOKEN, R_RANK, R_TRUNCATED };

/* The reason code of one 48-byte header, as dgt.wire.validate marks it (the first failing check wins). p: limits
 * max_payload, max_bucket_elems, max_control, max_rank; ft: DATA, CONTROL, BULK, last frame type. */
static int check_header(const unsigned char *h, const int64_t *lim, const int64_t *ft, const unsigned char *isz,
                        Py_ssize_t nisz, int has_token, uint64_t token, unsigned magic, unsigned version) {
    unsigned ftype = h[3], dt = h[5];
    int64_t length = be32(h + H_LENGTH), count = be32(h + H_COUNT);
    uint64_t offset = be64(h + H_OFFSET), block = be32(h + H_BLOCK), end = offset + (uint64_t)count;
    int bulk = ftype == ft[2], data = ftype == ft[0] || bulk;
    if (((unsigned)h[0] << 8 | h[1]) != magic) return R_MAGIC;
    if (h[2] != version) return R_VERSION;
    if (ftype < ft[0] || ftype > ft[3]) return R_FTYPE;
    if (dt >= nisz) return R_DTYPE;
    if (length > lim[0]) return R_LENGTH;
    if (data && count * isz[dt] != length) return R_COUNT;
    if (data && (end > (uint64_t)lim[1] || offset > (uint64_t)lim[1])) return R_COUNT;
    if (bulk && (block > (uint64_t)lim[1] || end > block)) return R_COUNT;
    if (ftype == ft[1] && length > lim[2]) return R_LENGTH;
    if (has_token && be64(h + 8) != token) return R_TOKEN;
    if ((int64_t)be32(h + 16) >= lim[3]) return R_RANK;
    return 0;
}

/* decode(buf, sizes, headers_out, pos_out, reason_out, limits, ftypes, itemsizes, has_token, token, magic, version,
 * flag_mac): dgt.wire.decode_datagrams in one pass (its twin): per datagram its 48-byte header copied out (of a
 * datagram shorter than a header, the 48 bytes at min(start, len - 48), or zeros when buf is shorter), its payload
 * position, and its reason code (header checks, then header + length (+ tag) == size, then truncation). */
static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer buf, sizes, hout, pout, rout, lim, ft, isz;
    int has_token, fmac;
    unsigned long long token;
    unsigned int magic, version;
    if (!PyArg_ParseTuple(args, "y*y*w*w*w*y*y*y*pKIIi", &buf, &sizes, &hout, &pout, &rout, &lim, &ft, &isz,
                          &has_token, &token, &magic, &version, &fmac))
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = sizes.len / 8;
    if (sizes.len % 8 || hout.len != n * H_SIZE || pout.len != n * 8 || rout.len != n || lim.len != 32 ||
        ft.len != 32) {
        PyErr_SetString(PyExc_ValueError, "decode: int64 sizes, [n, 48] headers, n positions and reasons, 4 limits");
        goto done;
    }
    {
        const unsigned char *b = buf.buf;
        const int64_t *sz = sizes.buf, *l = lim.buf, *f = ft.buf;
        unsigned char *ho = hout.buf;
        int64_t *po = pout.buf;
        int8_t *ro = rout.buf;
        int64_t start = 0, blen = buf.len;
        for (Py_ssize_t i = 0; i < n; i++) {
            unsigned char *h = ho + H_SIZE * i;
            if (blen >= H_SIZE)
                memcpy(h, b + (start < blen - H_SIZE ? start : blen - H_SIZE), H_SIZE);
            else
                memset(h, 0, H_SIZE);
            int r = check_header(h, l, f, isz.buf, isz.len, has_token, token, magic, version);
            int64_t tag = (h[H_FLAGS] & fmac) ? 8 : 0;
            if (!r && (int64_t)be32(h + H_LENGTH) + H_SIZE + tag != sz[i]) r = R_LENGTH;
            if (sz[i] < H_SIZE) r = R_TRUNCATED;
            ro[i] = (int8_t)r;
            po[i] = start + H_SIZE;
            start += sz[i];
        }
    }
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&hout);
    PyBuffer_Release(&pout);
    PyBuffer_Release(&rout);
    PyBuffer_Release(&lim);
    PyBuffer_Release(&ft);
    PyBuffer_Release(&isz);
    return res;
}

/* all_fragments(headers, reasons, data_ftype, fragment_flag): whether every datagram of a decoded read is valid
 * (reason 0), DATA, and a fragment: the receiver's common case, which then skips its screening masks. */
static PyObject *all_fragments(PyObject *self, PyObject *args) {
    Py_buffer hdr, rsn;
    unsigned int data, frag;
    if (!PyArg_ParseTuple(args, "y*y*II", &hdr, &rsn, &data, &frag)) return NULL;
    PyObject *res = NULL;
    if (hdr.len != rsn.len * H_SIZE) {
        PyErr_SetString(PyExc_ValueError, "all_fragments: one 48-byte header per reason code");
    } else {
        const unsigned char *h = hdr.buf;
        const int8_t *r = rsn.buf;
        int all = 1;
        for (Py_ssize_t i = 0; i < rsn.len && all; i++)
            all = r[i] == 0 && h[H_SIZE * i + 3] == data && (h[H_SIZE * i + H_FLAGS] & frag);
        res = PyBool_FromLong(all);
    }
    PyBuffer_Release(&hdr);
    PyBuffer_Release(&rsn);
    return res;
}

static PyMethodDef methods[] = {
    {"tags", tags, METH_VARARGS,
     "tags(buf, starts_int64, nbytes, key_uint32, add, pads_uint64, write): MAC tags of rows buf[s : s + nbytes] "
     "written after each row (write) or checked against what is there (bytes of 0/1)"},
    {"land", land, METH_VARARGS,
     "land(...): one round's fragments validated, MAC-checked, de-duplicated, copied and marked in one pass "
     "(see dgt/protocol/fused_landing.py)"},
    {"decode", decode, METH_VARARGS,
     "decode(buf, sizes, headers, positions, reasons, ...): dgt.wire.decode_datagrams in one C pass "
     "(see dgt/protocol/datagram_decode.py)"},
    {"all_fragments", all_fragments, METH_VARARGS,
     "all_fragments(headers, reasons, data_ftype, fragment_flag): every datagram a valid DATA fragment"},
    {"nh", nh, METH_VARARGS,
     "nh(data, starts_int64, nbytes, key_uint32, out_uint64): NH of each row data[s : s + nbytes] (zero-padded to "
     "8 bytes) into out"},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nh", "NH universal hash over byte rows.", -1, methods};
PyMODINIT_FUNC PyInit__nh(void) { return PyModule_Create(&module); }
