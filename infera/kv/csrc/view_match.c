/* GpuView's prefix matches: how far a prompt's blocks are held, by any target or by each of a set
 * of targets, in one walk. In C because every routed request walks its blocks here. */
#include "view.h"

/* first_unheld(hashes, start=0) -> position of the first of hashes[start:] no target holds */
PyObject *
infera_GpuView_first_unheld(GpuView *v, PyObject *args)
{
    PyObject *hashes;
    Py_ssize_t start = 0;
    if (!PyArg_ParseTuple(args, "O|n:first_unheld", &hashes, &start))
        return NULL;
    if (start < 0) {
        PyErr_SetString(PyExc_ValueError, "start must be >= 0");
        return NULL;
    }
    Hashes hs;
    if (infera_hashes_get(hashes, &hs) < 0)
        return NULL;
    Py_ssize_t i = start;
    for (; i < hs.n; i++) {
        uint64_t key;
        if (hashes_at(&hs, i, &key) < 0 || h_find(&v->holders, key) == NULL)
            break;
    }
    hashes_release(&hs);
    return PyLong_FromSsize_t(i);
}

/* match_one(hashes, bit) -> length of the prefix of hashes in that target's view */
PyObject *
infera_GpuView_match_one(GpuView *v, PyObject *args)
{
    PyObject *hashes, *bobj;
    if (!PyArg_ParseTuple(args, "OO:match_one", &hashes, &bobj))
        return NULL;
    long b = PyLong_AsLong(bobj);
    if (b == -1 && PyErr_Occurred())
        return NULL;
    if (b < 0 || b >= v->ntargets || !v->targets[b].live)
        return PyLong_FromLong(0);
    Hashes hs;
    if (infera_hashes_get(hashes, &hs) < 0)
        return NULL;
    Py_ssize_t i = 0;
    for (; i < hs.n; i++) {
        uint64_t key;
        if (hashes_at(&hs, i, &key) < 0 || !h_has_bit(&v->holders, key, (int)b))
            break;
    }
    hashes_release(&hs);
    return PyLong_FromSsize_t(i);
}

/* match(hashes, bits) -> for each bit (-1: no such target, 0), the length of the longest prefix of
 * hashes in that target's view. One walk for all: the candidates' bits that are still alive are
 * and-ed with each block's holder bits, a candidate's length is fixed when its bit dies, and the
 * walk ends when none is alive. */
PyObject *
infera_GpuView_match(GpuView *v, PyObject *args)
{
    PyObject *hashes, *bits_obj;
    if (!PyArg_ParseTuple(args, "OO:match", &hashes, &bits_obj))
        return NULL;
    PyObject *bseq = PySequence_Fast(bits_obj, "bits must be a sequence");
    if (bseq == NULL)
        return NULL;
    Hashes hs;
    if (infera_hashes_get(hashes, &hs) < 0) {
        Py_DECREF(bseq);
        return NULL;
    }
    Py_ssize_t nc = PySequence_Fast_GET_SIZE(bseq), nh = hs.n;
    PyObject **bitems = PySequence_Fast_ITEMS(bseq);
    int words = v->holders.words;
    int stack_bits[64];
    Py_ssize_t stack_depth[64];
    uint64_t stack_alive[8];
    int *bits = nc <= 64 ? stack_bits : PyMem_Malloc((size_t)nc * sizeof(int));
    Py_ssize_t *depth = nc <= 64 ? stack_depth : PyMem_Malloc((size_t)nc * sizeof(Py_ssize_t));
    uint64_t *alive = words <= 8 ? stack_alive : PyMem_Calloc((size_t)words, sizeof(uint64_t));
    PyObject *out = NULL;
    if (bits == NULL || depth == NULL || alive == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memset(alive, 0, (size_t)words * sizeof(uint64_t));
    int any = 0;
    for (Py_ssize_t c = 0; c < nc; c++) {
        long b = PyLong_AsLong(bitems[c]);
        if (b == -1 && PyErr_Occurred())
            goto done;
        if (b < 0 || b >= v->ntargets || !v->targets[b].live) {
            bits[c] = -1;
            depth[c] = 0;
            continue;
        }
        bits[c] = (int)b;
        depth[c] = nh; /* held all the way, unless its bit dies */
        alive[b >> 6] |= 1ULL << (b & 63);
        any = 1;
    }
    if (!any || nh == 0) {
        for (Py_ssize_t c = 0; c < nc; c++)
            depth[c] = 0;
    }
    else if (words == 1) {
        uint64_t a = alive[0];
        for (Py_ssize_t i = 0; i < nh; i++) {
            uint64_t key, held = 0;
            if (hashes_at(&hs, i, &key) == 0) {
                uint64_t *slot = h_find(&v->holders, key);
                if (slot != NULL)
                    held = slot[1] & a;
            }
            if (held != a) {
                uint64_t dead = a ^ held;
                for (Py_ssize_t c = 0; c < nc; c++) {
                    if (bits[c] >= 0 && (dead >> bits[c]) & 1)
                        depth[c] = i;
                }
                a = held;
                if (!a)
                    break;
            }
        }
    }
    else {
        for (Py_ssize_t i = 0; i < nh; i++) {
            uint64_t key;
            uint64_t *slot = NULL;
            if (hashes_at(&hs, i, &key) == 0)
                slot = h_find(&v->holders, key);
            int left = 0, changed = 0;
            for (int w = 0; w < words; w++) {
                uint64_t held = slot ? slot[1 + w] & alive[w] : 0;
                if (held != alive[w]) {
                    uint64_t dead = alive[w] ^ held;
                    for (Py_ssize_t c = 0; c < nc; c++) {
                        if (bits[c] >= 0 && (bits[c] >> 6) == w && (dead >> (bits[c] & 63)) & 1)
                            depth[c] = i;
                    }
                    alive[w] = held;
                    changed = 1;
                }
                left |= alive[w] != 0;
            }
            if (changed && !left)
                break;
        }
    }
    out = PyList_New(nc);
    if (out == NULL)
        goto done;
    for (Py_ssize_t c = 0; c < nc; c++) {
        PyObject *d = PyLong_FromSsize_t(depth[c]);
        if (d == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, c, d);
    }
done:
    if (bits != stack_bits)
        PyMem_Free(bits);
    if (depth != stack_depth)
        PyMem_Free(depth);
    if (alive != stack_alive)
        PyMem_Free(alive);
    Py_DECREF(bseq);
    hashes_release(&hs);
    return out;
}
