/* LandedClaims: blocks a target computed for requests that finished there, not yet confirmed by
 * its KV events (infera/router/kv_aware.py, "landed"). In C because every pick extends its hit
 * over them per block. */
#include "ids.h"
#include "u64table.h"

/* ------------------------------------------------------------------------------------------ */
/* LandedClaims                                                                                */

/* Blocks a target computed for requests that finished there, not yet confirmed by its KV events:
 * hash -> (finished_at, expiry), oldest first (infera/router/kv_aware.py, "landed"). A hash table
 * over slots chained in arrival order; a freed slot is reused. */
typedef struct {
    uint64_t key;
    double finished;
    double expiry;
    int64_t prev, next;
} Claim;

typedef struct {
    PyObject_HEAD
    Map64 index;    /* hash -> slot */
    Claim *slots;
    int64_t cap, used, head, tail, free_head;
    int64_t count;
} LandedClaims;

static void
LandedClaims_dealloc(LandedClaims *lc)
{
    map_free(&lc->index);
    PyMem_Free(lc->slots);
    Py_TYPE(lc)->tp_free((PyObject *)lc);
}

static int
LandedClaims_init(LandedClaims *lc, PyObject *args, PyObject *kwds)
{
    if (!PyArg_ParseTuple(args, ":LandedClaims"))
        return -1;
    lc->head = lc->tail = lc->free_head = -1;
    return 0;
}

static void
claims_unlink(LandedClaims *lc, int64_t i)
{
    Claim *c = &lc->slots[i];
    if (c->prev >= 0)
        lc->slots[c->prev].next = c->next;
    else
        lc->head = c->next;
    if (c->next >= 0)
        lc->slots[c->next].prev = c->prev;
    else
        lc->tail = c->prev;
}

static void
claims_append(LandedClaims *lc, int64_t i)
{
    Claim *c = &lc->slots[i];
    c->prev = lc->tail;
    c->next = -1;
    if (lc->tail >= 0)
        lc->slots[lc->tail].next = i;
    else
        lc->head = i;
    lc->tail = i;
}

/* drop the oldest claim */
static void
claims_pop_head(LandedClaims *lc)
{
    int64_t i = lc->head;
    uint32_t dummy;
    claims_unlink(lc, i);
    map_pop(&lc->index, lc->slots[i].key, &dummy);
    lc->slots[i].next = lc->free_head;
    lc->free_head = i;
    lc->count--;
}

static int64_t
claims_new_slot(LandedClaims *lc)
{
    if (lc->free_head >= 0) {
        int64_t i = lc->free_head;
        lc->free_head = lc->slots[i].next;
        return i;
    }
    if (lc->used == lc->cap) {
        int64_t ncap = lc->cap ? lc->cap * 2 : 64;
        Claim *s = PyMem_Realloc(lc->slots, (size_t)ncap * sizeof(Claim));
        if (s == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        lc->slots = s;
        lc->cap = ncap;
    }
    return lc->used++;
}

/* land(blocks, finished_at, expiry, cap): each block claimed (a claim already there keeps the later
 * finish, takes the new expiry, and moves to the end), then the oldest dropped beyond ``cap`` */
static PyObject *
LandedClaims_land(LandedClaims *lc, PyObject *args)
{
    PyObject *blocks;
    double finished, expiry;
    Py_ssize_t cap;
    if (!PyArg_ParseTuple(args, "Oddn:land", &blocks, &finished, &expiry, &cap))
        return NULL;
    Hashes hs;
    if (infera_hashes_get(blocks, &hs) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < hs.n; i++) {
        uint64_t key;
        if (hashes_at(&hs, i, &key) < 0)
            continue;
        int64_t at = map_find(&lc->index, key);
        if (at >= 0) {
            int64_t slot = (int64_t)lc->index.vals[at];
            Claim *c = &lc->slots[slot];
            if (c->finished <= finished)
                c->finished = finished;
            c->expiry = expiry;
            if (slot != lc->tail) {
                claims_unlink(lc, slot);
                claims_append(lc, slot);
            }
            continue;
        }
        int64_t slot = claims_new_slot(lc);
        if (slot < 0 || infera_map_put(&lc->index, key, (uint64_t)slot) < 0) {
            hashes_release(&hs);
            return NULL;
        }
        Claim *c = &lc->slots[slot];
        c->key = key;
        c->finished = finished;
        c->expiry = expiry;
        claims_append(lc, slot);
        lc->count++;
    }
    hashes_release(&hs);
    while (lc->count > cap && lc->head >= 0)
        claims_pop_head(lc);
    Py_RETURN_NONE;
}

/* extend(hashes, hit, caught_up, now) -> hit extended by the claims that still count: the oldest
 * claims the events caught up with (finished at or before ``caught_up``) or past their expiry are
 * dropped first, then hashes[hit:] are walked while each has a claim that counts (claims arrive a
 * little out of order from other replicas: each is checked) */
static PyObject *
LandedClaims_extend(LandedClaims *lc, PyObject *args)
{
    PyObject *hashes;
    Py_ssize_t hit;
    double caught_up, now;
    if (!PyArg_ParseTuple(args, "Ondd:extend", &hashes, &hit, &caught_up, &now))
        return NULL;
    while (lc->head >= 0) {
        Claim *c = &lc->slots[lc->head];
        if (c->finished > caught_up && c->expiry > now)
            break;
        claims_pop_head(lc);
    }
    if (lc->count == 0)
        return PyLong_FromSsize_t(hit);
    Hashes hs;
    if (infera_hashes_get(hashes, &hs) < 0)
        return NULL;
    for (; hit >= 0 && hit < hs.n; hit++) {
        uint64_t key;
        if (hashes_at(&hs, hit, &key) < 0)
            break;
        int64_t at = map_find(&lc->index, key);
        if (at < 0)
            break;
        Claim *c = &lc->slots[lc->index.vals[at]];
        if (c->finished <= caught_up || c->expiry <= now)
            break;
    }
    hashes_release(&hs);
    return PyLong_FromSsize_t(hit);
}

/* expire(now): drop the oldest claims past their expiry */
static PyObject *
LandedClaims_expire(LandedClaims *lc, PyObject *arg)
{
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    while (lc->head >= 0 && lc->slots[lc->head].expiry <= now)
        claims_pop_head(lc);
    Py_RETURN_NONE;
}

/* get(hash) -> (finished_at, expiry) or None */
static PyObject *
LandedClaims_get(LandedClaims *lc, PyObject *h)
{
    uint64_t key;
    if (router_key(h, &key) < 0)
        Py_RETURN_NONE;
    int64_t at = map_find(&lc->index, key);
    if (at < 0)
        Py_RETURN_NONE;
    Claim *c = &lc->slots[lc->index.vals[at]];
    return Py_BuildValue("(dd)", c->finished, c->expiry);
}

/* keys() -> the claimed hashes, oldest first */
static PyObject *
LandedClaims_keys(LandedClaims *lc, PyObject *unused)
{
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (int64_t i = lc->head; i >= 0; i = lc->slots[i].next) {
        PyObject *h = PyLong_FromUnsignedLongLong(lc->slots[i].key);
        if (h == NULL || PyList_Append(out, h) < 0) {
            Py_XDECREF(h);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(h);
    }
    return out;
}

static PyObject *
LandedClaims_iter(LandedClaims *lc)
{
    PyObject *keys = LandedClaims_keys(lc, NULL);
    if (keys == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static int
LandedClaims_contains(LandedClaims *lc, PyObject *h)
{
    uint64_t key;
    if (router_key(h, &key) < 0)
        return 0;
    return map_find(&lc->index, key) >= 0;
}

static Py_ssize_t
LandedClaims_len(LandedClaims *lc)
{
    return (Py_ssize_t)lc->count;
}

static PyMethodDef LandedClaims_methods[] = {
    {"land", (PyCFunction)LandedClaims_land, METH_VARARGS, "land(blocks, finished_at, expiry, cap)"},
    {"extend", (PyCFunction)LandedClaims_extend, METH_VARARGS, "extend(hashes, hit, caught_up, now) -> hit"},
    {"expire", (PyCFunction)LandedClaims_expire, METH_O, "expire(now): drop the expired oldest claims"},
    {"get", (PyCFunction)LandedClaims_get, METH_O, "get(hash) -> (finished_at, expiry) or None"},
    {"keys", (PyCFunction)LandedClaims_keys, METH_NOARGS, "keys() -> the claimed hashes, oldest first"},
    {NULL},
};

static PySequenceMethods LandedClaims_as_sequence = {
    .sq_length = (lenfunc)LandedClaims_len,
    .sq_contains = (objobjproc)LandedClaims_contains,
};

PyTypeObject infera_LandedClaimsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "infera.kv._native.LandedClaims",
    .tp_doc = "Landed claims: block hash -> (finished_at, expiry), oldest first.",
    .tp_basicsize = sizeof(LandedClaims),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)LandedClaims_init,
    .tp_dealloc = (destructor)LandedClaims_dealloc,
    .tp_methods = LandedClaims_methods,
    .tp_as_sequence = &LandedClaims_as_sequence,
    .tp_iter = (getiterfunc)LandedClaims_iter,
};
