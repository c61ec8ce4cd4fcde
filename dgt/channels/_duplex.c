/* One full-duplex hop of an ordered lossless message exchange, with the GIL released.
 *
 * Sends header + payload on one TCP socket while it receives an expected header + payload from another (the same
 * socket when both neighbours are one peer). Optionally adds each received float32 stretch to a source buffer while
 * it is still in cache: land[i] = src[i] + received[i]. Both sockets must be non-blocking and owned by the caller
 * for the duration. The C loop exists because a Python loop pays more per system call than the copy it drives; the
 * pure-Python twin in dgt/channels/duplex.py has the same contract.
 *
 * Returns (code, bytes sent, bytes received, received header): code 0 done, else a negative errno:
 * -EPROTO the header is not the expected one, -EPIPE end of stream, -ETIMEDOUT no progress for timeout_ms,
 * -ECANCELED the cancel fd became readable, others from the system calls.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#define LOWAT_MIN (128 * 1024) /* rests shorter than this are read as they come */
#define LOWAT_MAX (1024 * 1024) /* wake once at least this much of a large payload is in */
#define HEADER_MAX 256

typedef struct {
    int sfd, rfd, cancel_fd, timeout_ms;
    int do_send, do_recv, abort_fd; /* split mode: this side's half of the hop; the other half's failure wakes it */
    const char *sh, *sb, *eh, *addsrc;
    size_t shn, sbn, ehn, rbn, scn;
    char *rb, *scratch;
    size_t sent, got;
    char hdr[HEADER_MAX];
} hop_t;

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void add_f32(float *dst, const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = a[i] + b[i];
}

static int again(void) { return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR; }

static int set_lowat(int fd, int want, int *cur) {
    if (want != *cur && setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want) == 0) *cur = want;
    return *cur;
}

#define ABORTED (-100000) /* split mode: the other half failed first */

static int run(hop_t *h) {
    size_t stot = h->do_send ? h->shn + h->sbn : 0, rtot = h->do_recv ? h->ehn + h->rbn : 0;
    size_t pend = 0, added = 0; /* add mode: bytes waiting in scratch, payload bytes already summed */
    int lowat = 1, rc = 0;
    long long last = now_ms();
    while (h->sent < stot || h->got < rtot) {
        int prog = 0;
        if (h->sent < stot) {
            struct iovec iov[2];
            int n = 0;
            if (h->sent < h->shn) {
                iov[n].iov_base = (void *)(h->sh + h->sent);
                iov[n++].iov_len = h->shn - h->sent;
            }
            size_t off = h->sent > h->shn ? h->sent - h->shn : 0;
            if (off < h->sbn) {
                iov[n].iov_base = (void *)(h->sb + off);
                iov[n++].iov_len = h->sbn - off;
            }
            struct msghdr m;
            memset(&m, 0, sizeof m);
            m.msg_iov = iov;
            m.msg_iovlen = n;
            ssize_t k = sendmsg(h->sfd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (k > 0) {
                h->sent += (size_t)k;
                prog = 1;
            } else if (k < 0 && !again()) {
                rc = -errno;
                break;
            }
        }
        if (h->got < rtot) {
            ssize_t k;
            size_t before = h->got;
            if (h->got < h->ehn)
                k = recv(h->rfd, h->hdr + h->got, h->ehn - h->got, MSG_DONTWAIT);
            else if (h->addsrc) {
                size_t room = h->scn - pend, left = rtot - h->got;
                k = recv(h->rfd, h->scratch + pend, room < left ? room : left, MSG_DONTWAIT);
            } else
                k = recv(h->rfd, h->rb + (h->got - h->ehn), rtot - h->got, MSG_DONTWAIT);
            if (k == 0) {
                rc = -EPIPE;
                break;
            }
            if (k > 0) {
                h->got += (size_t)k;
                prog = 1;
                if (before < h->ehn && h->got == h->ehn && memcmp(h->hdr, h->eh, h->ehn) != 0) {
                    rc = -EPROTO;
                    break;
                }
                if (h->addsrc && before >= h->ehn) {
                    pend += (size_t)k;
                    if (pend == h->scn || h->got == rtot) {
                        size_t whole = pend & ~(size_t)3;
                        add_f32((float *)(h->rb + added), (const float *)(h->addsrc + added),
                                (const float *)h->scratch, whole / 4);
                        added += whole;
                        memmove(h->scratch, h->scratch + whole, pend - whole);
                        pend -= whole;
                    }
                }
            } else if (!again()) {
                rc = -errno;
                break;
            }
        }
        if (prog) {
            last = now_ms();
            continue;
        }
        struct pollfd p[4];
        int n = 0;
        if (h->abort_fd >= 0) {
            p[n].fd = h->abort_fd;
            p[n++].events = POLLIN;
        }
        if (h->sent < stot) {
            p[n].fd = h->sfd;
            p[n++].events = POLLOUT;
        }
        if (h->got < rtot) {
            size_t left = rtot - h->got;
            if (h->addsrc && h->got >= h->ehn && left > h->scn - pend) left = h->scn - pend;
            int want = left >= LOWAT_MIN ? (int)(left < LOWAT_MAX ? left : LOWAT_MAX) : 1;
            set_lowat(h->rfd, want, &lowat);
            p[n].fd = h->rfd;
            p[n++].events = POLLIN;
        }
        if (h->cancel_fd >= 0) {
            p[n].fd = h->cancel_fd;
            p[n++].events = POLLIN;
        }
        long long wait = last + h->timeout_ms - now_ms();
        if (wait <= 0) {
            rc = -ETIMEDOUT;
            break;
        }
        int r = poll(p, n, (int)wait);
        if (r < 0 && errno != EINTR) {
            rc = -errno;
            break;
        }
        if (h->cancel_fd >= 0 && r > 0 && (p[n - 1].revents & POLLIN)) {
            rc = -ECANCELED;
            break;
        }
        if (h->abort_fd >= 0 && r > 0 && (p[0].revents & POLLIN)) {
            rc = ABORTED;
            break;
        }
    }
    if (lowat != 1) set_lowat(h->rfd, 1, &lowat);
    if (rc && rc != ABORTED && h->abort_fd >= 0) {
        uint64_t one = 1;
        if (write(h->abort_fd, &one, sizeof one) < 0) { /* the other half then ends at its own timeout */
        }
    }
    return rc;
}

typedef struct {
    hop_t *h;
    int rc;
} half_t;

static void *send_half(void *arg) {
    half_t *t = (half_t *)arg;
    t->rc = run(t->h);
    return NULL;
}

/* Split mode: the send half on a second thread, the receive half (header check, add) on this one, so that the two
 * kernel copies of a hop run on two cores. They share nothing but the read-only hop description and the abort
 * eventfd; each writes only its own counters. Falls back to one thread if no eventfd or thread can be had. */
static int run_split(hop_t *h) {
    int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (efd < 0) return run(h);
    hop_t tx = *h;
    tx.do_recv = 0;
    tx.abort_fd = efd;
    h->do_send = 0;
    h->abort_fd = efd;
    half_t t = {&tx, 0};
    pthread_t th;
    if (pthread_create(&th, NULL, send_half, &t) != 0) {
        close(efd);
        h->do_send = 1;
        h->abort_fd = -1;
        return run(h);
    }
    int rc = run(h);
    pthread_join(th, NULL);
    close(efd);
    h->sent = tx.sent;
    if (rc == ABORTED || rc == 0) rc = t.rc == ABORTED ? 0 : t.rc;
    return rc;
}

static PyObject *duplex(PyObject *self, PyObject *args) {
    hop_t h;
    memset(&h, 0, sizeof h);
    Py_buffer sh, sb, eh, rb, as = {0}, sc = {0};
    PyObject *addobj, *scobj;
    int split = 0;
    if (!PyArg_ParseTuple(args, "iy*y*iy*w*OOii|p", &h.sfd, &sh, &sb, &h.rfd, &eh, &rb, &addobj, &scobj,
                          &h.timeout_ms, &h.cancel_fd, &split))
        return NULL;
    h.do_send = h.do_recv = 1;
    h.abort_fd = -1;
    PyObject *res = NULL;
    int have_add = 0, have_sc = 0;
    if (eh.len > HEADER_MAX) {
        PyErr_SetString(PyExc_ValueError, "expected header too long");
        goto out;
    }
    if (addobj != Py_None) {
        if (PyObject_GetBuffer(addobj, &as, PyBUF_SIMPLE) < 0) goto out;
        have_add = 1;
        if (PyObject_GetBuffer(scobj, &sc, PyBUF_WRITABLE) < 0) goto out;
        have_sc = 1;
        if (as.len != rb.len || rb.len % 4 || sc.len < 4 || sc.len % 4) {
            PyErr_SetString(PyExc_ValueError, "add: source and landing must be float32 of one length, scratch a "
                                              "multiple of 4 bytes");
            goto out;
        }
        h.addsrc = as.buf;
        h.scratch = sc.buf;
        h.scn = (size_t)sc.len;
    }
    h.sh = sh.buf; h.shn = (size_t)sh.len;
    h.sb = sb.buf; h.sbn = (size_t)sb.len;
    h.eh = eh.buf; h.ehn = (size_t)eh.len;
    h.rb = rb.buf; h.rbn = (size_t)rb.len;
    if (h.sfd < 0) h.shn = h.sbn = 0;
    if (h.rfd < 0) h.ehn = h.rbn = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = split && h.sfd >= 0 && h.rfd >= 0 ? run_split(&h) : run(&h);
    Py_END_ALLOW_THREADS
    res = Py_BuildValue("(inny#)", rc, (Py_ssize_t)h.sent, (Py_ssize_t)h.got, h.hdr,
                        (Py_ssize_t)(h.got < h.ehn ? h.got : h.ehn));
out:
    PyBuffer_Release(&sh);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&eh);
    PyBuffer_Release(&rb);
    if (have_add) PyBuffer_Release(&as);
    if (have_sc) PyBuffer_Release(&sc);
    return res;
}

static PyMethodDef methods[] = {
    {"duplex", duplex, METH_VARARGS,
     "duplex(send_fd, header, payload, recv_fd, expect, land, add_src, scratch, timeout_ms, cancel_fd, split=False)"
     " -> (code, sent, received, header); split: send on a second thread"},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_duplex", "Native full-duplex hop loop.", -1, methods};
PyMODINIT_FUNC PyInit__duplex(void) { return PyModule_Create(&module); }
