/* Token ids as u32 and router hashes as u64, read from Python objects: an array('I') / array('Q')
 * (or a memoryview cast so) is read in place, anything else converted once. In C because every
 * other file's loop reads its input this way, without an int object per item. */
#include "ids.h"

/* ------------------------------------------------------------------------------------------ */
/* token ids as u32                                                                            */

static int
is_u32_format(const char *format)
{
    if (format == NULL)
        return 0;
    if (format[0] == '<' || format[0] == '=' || format[0] == '@')
        format++;
    return (format[0] == 'I' || (format[0] == 'L' && sizeof(long) == 4)) && format[1] == '\0';
}

static int
u32_from_long(PyObject *item, uint32_t *out)
{
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "token ids must be ints, not %.100s", Py_TYPE(item)->tp_name);
        return -1;
    }
    unsigned long v = PyLong_AsUnsignedLong(item);
    if (v == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (v > 0xFFFFFFFFUL) {
        PyErr_SetString(PyExc_OverflowError, "token id does not fit in 32 bits");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

/* ``limit``: convert at most this many leading items of a sequence (-1: all) */
int
infera_u32_tokens(PyObject *obj, Py_ssize_t limit, U32Tokens *t)
{
    memset(t, 0, sizeof(*t));
    if (PyObject_CheckBuffer(obj) && !PyBytes_Check(obj) && !PyByteArray_Check(obj)) {
        if (PyObject_GetBuffer(obj, &t->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
            if (t->view.itemsize == 4 && is_u32_format(t->view.format)) {
                t->has_view = 1;
                t->ids = (const uint32_t *)t->view.buf;
                t->n = t->view.len / 4;
                return 0;
            }
            PyBuffer_Release(&t->view);
        }
        else {
            PyErr_Clear();
        }
    }
    PyObject *seq = PySequence_Fast(obj, "token ids must be a sequence of ints");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (limit >= 0 && limit < n)
        n = limit;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint32_t *ids = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    if (ids == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (u32_from_long(items[i], &ids[i]) < 0) {
            PyMem_Free(ids);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    t->ids = ids;
    t->owned = ids;
    t->n = n;
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* router hashes as u64                                                                        */

int
infera_hashes_get(PyObject *obj, Hashes *h)
{
    memset(h, 0, sizeof(*h));
    if (PyObject_CheckBuffer(obj) && !PyBytes_Check(obj) && !PyByteArray_Check(obj)) {
        if (PyObject_GetBuffer(obj, &h->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
            const char *f = h->view.format ? h->view.format : "B";
            if (*f == '<' || *f == '=' || *f == '@')
                f++;
            if (h->view.itemsize == 8 && (*f == 'Q' || *f == 'L' || *f == 'K') && f[1] == '\0') {
                h->has_view = 1;
                h->u64 = (const uint64_t *)h->view.buf;
                h->n = h->view.len / 8;
                return 0;
            }
            PyBuffer_Release(&h->view);
        }
        else {
            PyErr_Clear();
        }
    }
    h->seq = PySequence_Fast(obj, "hashes must be a sequence");
    if (h->seq == NULL)
        return -1;
    h->items = PySequence_Fast_ITEMS(h->seq);
    h->n = PySequence_Fast_GET_SIZE(h->seq);
    return 0;
}
