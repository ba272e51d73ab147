/* block_hashes(), block_hash_bytes() and prefix_keys(): the chained XXH3-64 block hashes of a
 * prompt (infera/kv/hashing.py) and the BlockHashCache's XXH3-128 keys of its prefixes. In C
 * because they hash per block of every prompt, which the interpreter did a bytecode at a time. */
#include "ids.h"
#include "xxh.h"

/* Chained block hashes: out[i] = infera_xxh3_64(parent_i as u64 LE ++ block i's ids as u32 LE), parent_0 =
 * ``parent``, parent_{i+1} = out[i]. ``scratch`` holds 8 + 4 * block_size bytes. */
static void
chain_hashes(const uint32_t *ids, Py_ssize_t nblocks, Py_ssize_t block_size, uint64_t parent,
             unsigned char *scratch, uint64_t *out)
{
    size_t span = (size_t)block_size * 4;
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        memcpy(scratch, &parent, 8);
        memcpy(scratch + 8, ids + i * block_size, span);
        parent = infera_xxh3_64(scratch, 8 + span);
        out[i] = parent;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* block_hashes(tokens, block_size, parent=0) -> list[int]                                     */

PyObject *
infera_py_block_hashes(PyObject *self, PyObject *args)
{
    PyObject *tokens;
    Py_ssize_t block_size;
    unsigned long long parent = 0;
    if (!PyArg_ParseTuple(args, "On|K:block_hashes", &tokens, &block_size, &parent))
        return NULL;
    if (block_size <= 0)
        return PyList_New(0);
    /* only the full blocks' ids are read (and checked), as the Python version converts them */
    Py_ssize_t len = PyObject_Length(tokens);
    if (len < 0)
        return NULL;
    U32Tokens t;
    if (infera_u32_tokens(tokens, len - len % block_size, &t) < 0)
        return NULL;
    Py_ssize_t nblocks = t.n / block_size;
    PyObject *out = PyList_New(nblocks);
    uint64_t *hashes = PyMem_Malloc((size_t)(nblocks ? nblocks : 1) * sizeof(uint64_t));
    unsigned char *scratch = PyMem_Malloc(8 + (size_t)block_size * 4);
    if (out == NULL || hashes == NULL || scratch == NULL) {
        Py_XDECREF(out);
        PyMem_Free(hashes);
        PyMem_Free(scratch);
        u32_release(&t);
        return PyErr_NoMemory();
    }
    chain_hashes(t.ids, nblocks, block_size, (uint64_t)parent, scratch, hashes);
    u32_release(&t);
    PyMem_Free(scratch);
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        PyObject *h = PyLong_FromUnsignedLongLong(hashes[i]);
        if (h == NULL) {
            PyMem_Free(hashes);
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, h);
    }
    PyMem_Free(hashes);
    return out;
}

/* block_hash_bytes(tokens, block_size, parent=0) -> bytes: the same chain as u64 little-endian
 * (an array('Q') takes it with frombytes: no int object per hash) */
PyObject *
infera_py_block_hash_bytes(PyObject *self, PyObject *args)
{
    PyObject *tokens;
    Py_ssize_t block_size;
    unsigned long long parent = 0;
    if (!PyArg_ParseTuple(args, "On|K:block_hash_bytes", &tokens, &block_size, &parent))
        return NULL;
    if (block_size <= 0)
        return PyBytes_FromStringAndSize(NULL, 0);
    Py_ssize_t len = PyObject_Length(tokens);
    if (len < 0)
        return NULL;
    U32Tokens t;
    if (infera_u32_tokens(tokens, len - len % block_size, &t) < 0)
        return NULL;
    Py_ssize_t nblocks = t.n / block_size;
    PyObject *out = PyBytes_FromStringAndSize(NULL, nblocks * 8);
    unsigned char *scratch = PyMem_Malloc(8 + (size_t)block_size * 4);
    if (out == NULL || scratch == NULL) {
        Py_XDECREF(out);
        PyMem_Free(scratch);
        u32_release(&t);
        return out == NULL ? NULL : PyErr_NoMemory();
    }
    chain_hashes(t.ids, nblocks, block_size, (uint64_t)parent, scratch, (uint64_t *)PyBytes_AS_STRING(out));
    PyMem_Free(scratch);
    u32_release(&t);
    return out;
}

/* ------------------------------------------------------------------------------------------ */
/* prefix_keys(data, stride, tag) -> list[bytes]                                               */

/* The BlockHashCache's keys for a prompt: ``tag`` + XXH3-128 (canonical, big-endian) of
 * data[:k * stride] for every k >= 1 with k * stride <= len(data): one streaming pass. */
PyObject *
infera_py_prefix_keys(PyObject *self, PyObject *args)
{
    Py_buffer data, tag;
    Py_ssize_t stride;
    if (!PyArg_ParseTuple(args, "y*ny*:prefix_keys", &data, &stride, &tag))
        return NULL;
    PyObject *out = NULL;
    void *state = NULL;
    if (stride <= 0) {
        PyErr_SetString(PyExc_ValueError, "stride must be > 0");
        goto done;
    }
    Py_ssize_t nkeys = data.len / stride;
    out = PyList_New(nkeys);
    if (out == NULL)
        goto done;
    if (nkeys == 0)
        goto done;
    state = infera_xxh_state;
    infera_xxh3_128_reset(state);
    const char *p = data.buf;
    for (Py_ssize_t k = 0; k < nkeys; k++) {
        infera_xxh3_128_update(state, p + k * stride, (size_t)stride);
        xxh128_t d = infera_xxh3_128_digest(state);
        PyObject *key = PyBytes_FromStringAndSize(NULL, tag.len + 16);
        if (key == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        unsigned char *kb = (unsigned char *)PyBytes_AS_STRING(key);
        memcpy(kb, tag.buf, (size_t)tag.len);
        for (int b = 0; b < 8; b++) {
            kb[tag.len + b] = (unsigned char)(d.high64 >> (56 - 8 * b));
            kb[tag.len + 8 + b] = (unsigned char)(d.low64 >> (56 - 8 * b));
        }
        PyList_SET_ITEM(out, k, key);
    }
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&tag);
    return out;
}
