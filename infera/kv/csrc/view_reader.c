/* GpuViewReader: another process's view of a shared GpuView (issue 30 item 4: one index per host,
 * written by one process, read by the others without locks). It maps the writer's arena read-only
 * and answers the prefix matches from it.
 *
 * Every block is read under seqlocks (arena.h, u64table.h): the arena's sequence (the table's
 * address) and those of the stripes of slots its probe run crosses are read (even: no change under
 * way), the run and the key's holder set are copied, and the sequences read again; if one moved, the
 * block is read again, at most READ_TRIES times, after which
 * the match gives no answer (None: the caller routes by load) instead of a wrong one. Nothing read is
 * trusted: every offset is checked against the mapping, every probe run and set against their
 * bounds, so a table freed or rewritten under a reader costs a retry, never a fault or a loop. The
 * writer's death leaves the mapping readable (the memory goes with the last process that maps it):
 * writer_alive() says whether it is still there. */
#include "view.h"

#include <errno.h>
#include <signal.h>
#include <sys/types.h>

#define READ_TRIES 64
#define SET_MAX_BYTES (sizeof(HBits) + (HS_MAX_IDS / 64) * 8) /* the largest set a writer makes */

typedef struct {
    PyObject_HEAD
    Arena arena;
    uint8_t *buf; /* a copy of the last external set read (its word points here) */
    size_t buf_len;
    uint64_t retries, failures; /* reads taken again; matches that gave no answer */
} GpuViewReader;

static int
reader_buf(GpuViewReader *r, size_t need)
{
    if (need <= r->buf_len)
        return 0;
    uint8_t *b = PyMem_Realloc(r->buf, need);
    if (b == NULL)
        return -1;
    r->buf = b;
    r->buf_len = need;
    return 0;
}

static inline void
cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

#define READ_STRIPES 16 /* stripes one probe run may cross (more: the attempt counts as failed) */

/* One consistent read of ``key``: 1 with its set word in *set (an external set copied into r->buf,
 * the word pointing at the copy), 0 when no target holds it, -1 when no consistent read came within
 * READ_TRIES (or no memory for the copy). Consistent: the arena's sequence (the table's address)
 * and the sequence of every stripe the probe run crossed (the slots and the set) were even and
 * the same before and after. A failed attempt waits a little longer each time for the writer's
 * change to end. */
static int
reader_get(GpuViewReader *r, uint64_t key, uint64_t *set)
{
    const Arena *a = &r->arena;
    const ArenaHeader *hd = arena_header(a);
    for (int attempt = 0; attempt < READ_TRIES; attempt++) {
        if (attempt) {
            r->retries++;
            for (int k = 0; k < (attempt < 16 ? attempt : 16) * 4; k++)
                cpu_relax();
        }
        uint64_t s1 = __atomic_load_n(&hd->seq, __ATOMIC_ACQUIRE);
        if (s1 & 1)
            continue;
        uint64_t off = __atomic_load_n(&hd->slots, __ATOMIC_RELAXED);
        uint64_t cap = __atomic_load_n(&hd->cap, __ATOMIC_RELAXED);
        if (cap == 0 && off == 0) { /* no table (the writer freed it): nothing is held */
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (__atomic_load_n(&hd->seq, __ATOMIC_RELAXED) != s1)
                continue;
            return 0;
        }
        if (cap > a->size / 17 || !arena_in(a, off, h_stripes_at(cap) + h_nstripes(cap) * 8))
            continue; /* torn: the sequence has moved */
        const uint64_t *slots = (const uint64_t *)(a->base + off);
        const uint64_t *stripes = (const uint64_t *)(a->base + off + h_stripes_at(cap));
        uint64_t seen[READ_STRIPES], seqs[READ_STRIPES];
        int nseen = 0, sane = 1, found = 0;
        uint64_t word = 0, i = h_home(key, cap);
        for (uint64_t probes = 0; probes < cap; probes++) { /* a full table (torn) ends here */
            uint64_t st = i >> H_STRIPE_SHIFT;
            if (nseen == 0 || seen[nseen - 1] != st) {
                uint64_t q = __atomic_load_n(&stripes[st], __ATOMIC_ACQUIRE);
                if (nseen == READ_STRIPES || (q & 1)) {
                    sane = 0;
                    break;
                }
                seen[nseen] = st;
                seqs[nseen++] = q;
            }
            uint64_t k = __atomic_load_n(&slots[2 * i], __ATOMIC_RELAXED);
            uint64_t v = __atomic_load_n(&slots[2 * i + 1], __ATOMIC_RELAXED);
            if (v == 0)
                break;
            if (k == key) {
                found = 1;
                word = v;
                break;
            }
            i = next_slot(i, cap);
        }
        if (sane && found && (word & HS_EXT)) { /* copy the set: what it points at may change under us */
            uint64_t at = word & HS_PTR_MASK, bytes = 0;
            if (arena_in(a, at, 8)) {
                uint32_t n, second;
                memcpy(&n, a->base + at, 4);
                memcpy(&second, a->base + at + 4, 4);
                if (word & HS_BITMAP) /* HBits: n, words */
                    bytes = second <= HS_MAX_IDS / 64 ? hbits_bytes(second) : 0;
                else /* HArr: n, cap */
                    bytes = second <= HS_MAX_IDS && n <= second ? harr_bytes(second) : 0;
            }
            if (bytes == 0 || bytes > SET_MAX_BYTES || !arena_in(a, at, bytes))
                sane = 0;
            else {
                if (reader_buf(r, bytes) < 0)
                    return -1;
                memcpy(r->buf, a->base + at, bytes);
                word = (uint64_t)(uintptr_t)r->buf | (word & (HS_EXT | HS_BITMAP));
            }
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        for (int k = 0; k < nseen && sane; k++)
            sane = __atomic_load_n(&stripes[seen[k]], __ATOMIC_RELAXED) == seqs[k];
        if (!sane || __atomic_load_n(&hd->seq, __ATOMIC_RELAXED) != s1)
            continue;
        *set = word;
        return found;
    }
    return -1;
}

static int
reader_bit_ok(void *ctx, uint32_t bit)
{
    (void)ctx;
    (void)bit;
    return 1; /* a bit no target holds anything under matches nothing */
}

static int
reader_lookup(void *ctx, uint64_t key, uint64_t *set)
{
    return reader_get((GpuViewReader *)ctx, key, set);
}

static int
GpuViewReader_init(GpuViewReader *r, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fd", NULL};
    int fd;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i:GpuViewReader", kwlist, &fd))
        return -1;
    if (r->arena.base != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "GpuViewReader is attached already");
        return -1;
    }
    return infera_arena_attach(&r->arena, fd);
}

static void
GpuViewReader_dealloc(GpuViewReader *r)
{
    if (r->arena.base != NULL)
        infera_arena_close(&r->arena);
    PyMem_Free(r->buf);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static int
reader_ready(GpuViewReader *r)
{
    if (r->arena.base == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "GpuViewReader is not attached");
        return -1;
    }
    return 0;
}

/* match(hashes, bits) -> for each bit, the longest prefix of hashes held; None: not readable now */
static PyObject *
GpuViewReader_match(GpuViewReader *r, PyObject *args)
{
    PyObject *hashes, *bits;
    if (!PyArg_ParseTuple(args, "OO:match", &hashes, &bits) || reader_ready(r) < 0)
        return NULL;
    MatchSource src = {r, 0, reader_bit_ok, reader_lookup, NULL}; /* sets are read as copies: base 0 */
    PyObject *out = infera_match_walk(&src, hashes, bits);
    if (out == Py_None)
        r->failures++;
    return out;
}

/* first_unheld(hashes, start=0) -> position of the first of hashes[start:] no target holds; None:
 * not readable now */
static PyObject *
GpuViewReader_first_unheld(GpuViewReader *r, PyObject *args)
{
    Hashes hs;
    Py_ssize_t start;
    if (reader_ready(r) < 0 || infera_first_unheld_args(args, &hs, &start) < 0)
        return NULL;
    Py_ssize_t i = start;
    int got = 1;
    for (; i < hs.n; i++) {
        uint64_t key, set;
        if (hashes_at(&hs, i, &key) < 0)
            break;
        got = reader_get(r, key, &set);
        if (got <= 0)
            break;
    }
    hashes_release(&hs);
    if (got < 0) {
        r->failures++;
        Py_RETURN_NONE;
    }
    return PyLong_FromSsize_t(i);
}

/* writer_alive() -> whether the process that writes the arena is still running */
static PyObject *
GpuViewReader_writer_alive(GpuViewReader *r, PyObject *unused)
{
    if (reader_ready(r) < 0)
        return NULL;
    pid_t pid = (pid_t)arena_header(&r->arena)->writer_pid;
    return PyBool_FromLong(pid > 0 && (kill(pid, 0) == 0 || errno == EPERM));
}

/* stats() -> (writer pid, arena bytes, bytes taken, the writer's changes so far, reads taken again,
 * reads with no answer) */
static PyObject *
GpuViewReader_stats(GpuViewReader *r, PyObject *unused)
{
    if (reader_ready(r) < 0)
        return NULL;
    const ArenaHeader *hd = arena_header(&r->arena);
    return Py_BuildValue("(LKKKKK)", (long long)hd->writer_pid, (unsigned long long)r->arena.size,
                         (unsigned long long)__atomic_load_n(&hd->used, __ATOMIC_RELAXED),
                         (unsigned long long)(__atomic_load_n(&hd->seq, __ATOMIC_RELAXED) / 2),
                         (unsigned long long)r->retries, (unsigned long long)r->failures);
}

static PyMethodDef GpuViewReader_methods[] = {
    {"match", (PyCFunction)GpuViewReader_match, METH_VARARGS,
     "match(hashes, bits) -> held prefix length per bit, or None when no consistent read came"},
    {"first_unheld", (PyCFunction)GpuViewReader_first_unheld, METH_VARARGS,
     "first_unheld(hashes, start=0) -> position of the first hash no target holds, or None"},
    {"writer_alive", (PyCFunction)GpuViewReader_writer_alive, METH_NOARGS,
     "writer_alive() -> whether the writing process still runs"},
    {"stats", (PyCFunction)GpuViewReader_stats, METH_NOARGS,
     "stats() -> (writer pid, arena bytes, bytes taken, the writer's changes, reads taken again, reads with no "
     "answer)"},
    {NULL},
};

PyTypeObject infera_GpuViewReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "infera.kv._native.GpuViewReader",
    .tp_doc = "GpuViewReader(fd): a shared GpuView's holder table, mapped read-only, matched without locks.",
    .tp_basicsize = sizeof(GpuViewReader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)GpuViewReader_init,
    .tp_dealloc = (destructor)GpuViewReader_dealloc,
    .tp_methods = GpuViewReader_methods,
};
