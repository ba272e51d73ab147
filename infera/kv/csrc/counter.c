/* BlockCounter: a multiset of block hashes (u64), the kv-aware policy's blocks in flight per
 * target (infera/router/kv_aware.py). In C because every pick reads it per block and every
 * request adds and removes its blocks. */
#include "counter.h"

/* ------------------------------------------------------------------------------------------ */
/* BlockCounter                                                                                */

static void
BlockCounter_dealloc(BlockCounter *bc)
{
    map_free(&bc->counts);
    Py_TYPE(bc)->tp_free((PyObject *)bc);
}

/* add(blocks): one more of each */
static PyObject *
BlockCounter_add(BlockCounter *bc, PyObject *blocks)
{
    Hashes hs;
    if (infera_hashes_get(blocks, &hs) < 0)
        return NULL;
    Map64 *m = &bc->counts;
    for (Py_ssize_t i = 0; i < hs.n; i++) {
        uint64_t key;
        if (hashes_at(&hs, i, &key) < 0)
            continue; /* not a block hash (a peer replica's bad message): never held */
        int64_t at = map_find(m, key);
        if (at >= 0) {
            m->vals[at]++;
        }
        else if (infera_map_put(m, key, 1) < 0) {
            hashes_release(&hs);
            return NULL;
        }
    }
    hashes_release(&hs);
    Py_RETURN_NONE;
}

/* remove(blocks): one fewer of each (a block at zero goes; one not held is skipped) */
static PyObject *
BlockCounter_remove(BlockCounter *bc, PyObject *blocks)
{
    Hashes hs;
    if (infera_hashes_get(blocks, &hs) < 0)
        return NULL;
    Map64 *m = &bc->counts;
    for (Py_ssize_t i = 0; i < hs.n && m->n; i++) {
        uint64_t key;
        if (hashes_at(&hs, i, &key) < 0)
            continue;
        int64_t at = map_find(m, key);
        if (at < 0)
            continue;
        if (m->vals[at] > 1)
            m->vals[at]--;
        else
            infera_map_delete_at(m, (uint64_t)at);
    }
    hashes_release(&hs);
    Py_RETURN_NONE;
}

Py_ssize_t
infera_counter_run(const Map64 *m, const Hashes *hs, Py_ssize_t start)
{
    Py_ssize_t i = start < 0 ? 0 : start;
    for (; i < hs->n; i++) {
        uint64_t key;
        if (hashes_at(hs, i, &key) < 0 || map_find(m, key) < 0)
            break;
    }
    return i < start ? start : i;
}

/* run(hashes, start) -> the first position >= start whose hash is not held (len: all are) */
static PyObject *
BlockCounter_run(BlockCounter *bc, PyObject *args)
{
    PyObject *hashes;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "On:run", &hashes, &start))
        return NULL;
    Hashes hs;
    if (infera_hashes_get(hashes, &hs) < 0)
        return NULL;
    Py_ssize_t i = infera_counter_run(&bc->counts, &hs, start);
    hashes_release(&hs);
    return PyLong_FromSsize_t(i);
}

/* count(hash) -> how many hold it (0: none) */
static PyObject *
BlockCounter_count(BlockCounter *bc, PyObject *h)
{
    uint64_t key;
    if (router_key(h, &key) < 0)
        return PyLong_FromLong(0);
    int64_t at = map_find(&bc->counts, key);
    return PyLong_FromUnsignedLongLong(at < 0 ? 0 : bc->counts.vals[at]);
}

/* items() -> [(hash, count)] */
static PyObject *
BlockCounter_items(BlockCounter *bc, PyObject *unused)
{
    Map64 *m = &bc->counts;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (uint64_t i = 0; i < m->cap; i++) {
        if (!map_used(m, i))
            continue;
        PyObject *pair = Py_BuildValue("(KK)", (unsigned long long)m->keys[i], (unsigned long long)m->vals[i]);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return out;
}

static int
BlockCounter_contains(BlockCounter *bc, PyObject *h)
{
    uint64_t key;
    if (router_key(h, &key) < 0)
        return 0;
    return map_find(&bc->counts, key) >= 0;
}

static Py_ssize_t
BlockCounter_len(BlockCounter *bc)
{
    return (Py_ssize_t)bc->counts.n;
}

static PyMethodDef BlockCounter_methods[] = {
    {"add", (PyCFunction)BlockCounter_add, METH_O, "add(blocks): one more of each"},
    {"remove", (PyCFunction)BlockCounter_remove, METH_O, "remove(blocks): one fewer of each"},
    {"run", (PyCFunction)BlockCounter_run, METH_VARARGS, "run(hashes, start) -> first position not held"},
    {"count", (PyCFunction)BlockCounter_count, METH_O, "count(hash) -> holders"},
    {"items", (PyCFunction)BlockCounter_items, METH_NOARGS, "items() -> [(hash, count)]"},
    {NULL},
};

static PySequenceMethods BlockCounter_as_sequence = {
    .sq_length = (lenfunc)BlockCounter_len,
    .sq_contains = (objobjproc)BlockCounter_contains,
};

PyTypeObject infera_BlockCounterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "infera.kv._native.BlockCounter",
    .tp_doc = "A multiset of block hashes (u64): add, remove, in, len, run.",
    .tp_basicsize = sizeof(BlockCounter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)BlockCounter_dealloc,
    .tp_methods = BlockCounter_methods,
    .tp_as_sequence = &BlockCounter_as_sequence,
};
