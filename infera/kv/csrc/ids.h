/* Token ids (u32) and router hashes (u64) read from Python objects: the memory of an array or a
 * memoryview as it is, else a sequence converted (ids.c). The small readers are inline: the walks
 * over a prompt's blocks call them per block. */
#ifndef INFERA_IDS_H
#define INFERA_IDS_H

#include "native.h"

/* ------------------------------------------------------------------------------------------ */
/* token ids as u32                                                                            */

/* A view of ``obj`` as u32 token ids: the memory of a buffer of 4-byte unsigned items (array('I'),
 * a memoryview cast to "I") as it is, else a sequence converted (errors as array('I') raises
 * them: OverflowError for a negative or too large id, TypeError for a non-int). */
typedef struct {
    const uint32_t *ids;
    Py_ssize_t n;
    Py_buffer view;
    int has_view;
    uint32_t *owned;
} U32Tokens;

/* ``limit``: convert at most this many leading items of a sequence (-1: all) */
INFERA_INTERNAL int infera_u32_tokens(PyObject *obj, Py_ssize_t limit, U32Tokens *t);

static inline void
u32_release(U32Tokens *t)
{
    if (t->has_view)
        PyBuffer_Release(&t->view);
    PyMem_Free(t->owned);
    t->owned = NULL;
    t->has_view = 0;
}

/* ------------------------------------------------------------------------------------------ */
/* router hashes as u64                                                                        */

/* A router hash from Python: -1 (and no error set) when ``obj`` is no u64, which no view holds */
static inline int
router_key(PyObject *obj, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    *out = v;
    return 0;
}

/* A sequence of router hashes: an array('Q') (or any buffer of 8-byte items) read in place, or a
 * sequence of ints. Chains are array('Q') on the hot path: a walk then reads contiguous u64s instead
 * of dereferencing an int object per block (cold in the server). */
typedef struct {
    const uint64_t *u64;
    PyObject **items;
    Py_ssize_t n;
    PyObject *seq;
    Py_buffer view;
    int has_view;
} Hashes;

INFERA_INTERNAL int infera_hashes_get(PyObject *obj, Hashes *h);

/* 0 and the hash in *key, or -1 when the item is no u64 (no view holds it) */
static inline int
hashes_at(const Hashes *h, Py_ssize_t i, uint64_t *key)
{
    if (h->u64 != NULL) {
        *key = h->u64[i];
        return 0;
    }
    return router_key(h->items[i], key);
}

static inline void
hashes_release(Hashes *h)
{
    if (h->has_view)
        PyBuffer_Release(&h->view);
    Py_XDECREF(h->seq);
    h->seq = NULL;
    h->has_view = 0;
}

#endif
