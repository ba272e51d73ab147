/* zmtp_split(): the ZMTP frame scanner of the transport's reader (infera/transport/zmtp.py
 * ``split``, its Python twin, documents the contract). In C because it reads every frame header of
 * every engine's event stream. */
#include "native.h"

/* ------------------------------------------------------------------------------------------ */
/* zmtp_split(buf, start, max_frame, max_message, max_frames, partial) -> (items, ends, error,  */
/*            partial)                                                                         */

/* Frame headers read by zmtp_split since the module was loaded (zmtp_headers_read()): what the
 * tests count to show that a message arriving in many reads is scanned once, not from its start
 * again on every read. */
static unsigned long long zmtp_headers;

/* The frames of a message of ``nframes`` frames at ``q`` (already scanned, so whole): a list of
 * bytes. The bounds are checked all the same: ``q`` may come from a caller's partial state. */
static PyObject *
zmtp_frames(const unsigned char *p, Py_ssize_t n, Py_ssize_t q, Py_ssize_t nframes)
{
    PyObject *item = PyList_New(nframes);
    for (Py_ssize_t f = 0; item != NULL && f < nframes; f++) {
        Py_ssize_t hdr = 2;
        unsigned long long size;
        if (q + 2 > n)
            goto bad;
        size = p[q + 1];
        if (p[q] & 0x02) {
            if (q + 9 > n)
                goto bad;
            size = read_be(p + q + 1, 8);
            hdr = 9;
        }
        zmtp_headers++;
        if ((unsigned long long)(n - q - hdr) < size)
            goto bad;
        PyObject *frame = PyBytes_FromStringAndSize((const char *)p + q + hdr, (Py_ssize_t)size);
        if (frame == NULL)
            Py_CLEAR(item);
        else
            PyList_SET_ITEM(item, f, frame);
        q += hdr + (Py_ssize_t)size;
    }
    return item;
bad:
    Py_DECREF(item);
    PyErr_SetString(PyExc_ValueError, "bad partial state");
    return NULL;
}

/* The complete items of a ZMTP frame stream from ``start`` (infera/transport/zmtp.py ``split``,
 * its Python twin, which documents the contract): a message as the list of its frames' bytes, a
 * command as its body (bytes); ``ends[i]`` is the offset just after item i. An incomplete frame,
 * or a message whose last frame has not arrived, ends the scan (nothing of it is taken); the
 * fourth value is then ``(message start, scan offset, frames, payload bytes)`` of that message
 * when it has whole frames already, to be passed back as ``partial`` with the next call so that
 * the scan resumes there (the buffer only grew meanwhile; the offsets shifted by what the caller
 * dropped from its front) instead of reading every frame of the message again on every read: a
 * publisher that never ends a message would otherwise cost a rescan of all of it per read.
 * ``error``: None, or why the stream is broken where the scan stopped, decided at the frame's
 * header, before its body arrives: a frame over ``max_frame`` bytes, a command among a message's
 * frames, a message of more than ``max_frames`` frames or ``max_message`` payload bytes; the items
 * before it are whole and delivered first. */
PyObject *
infera_py_zmtp_split(PyObject *self, PyObject *args)
{
    Py_buffer b;
    Py_ssize_t pos, max_frames;
    unsigned long long max_frame, max_message;
    PyObject *partial = Py_None;
    if (!PyArg_ParseTuple(args, "y*nKKn|O:zmtp_split", &b, &pos, &max_frame, &max_message, &max_frames,
                          &partial))
        return NULL;
    const unsigned char *p = b.buf;
    Py_ssize_t n = b.len;
    Py_ssize_t ms = -1, mscan = 0, mframes = 0, mtotal = 0;
    PyObject *items = PyList_New(0), *ends = PyList_New(0), *result = NULL, *error = NULL, *out = NULL;
    if (items == NULL || ends == NULL)
        goto done;
    if (pos < 0 || pos > n) {
        PyErr_SetString(PyExc_ValueError, "start out of range");
        goto done;
    }
    if (partial != Py_None) {
        if (!PyTuple_Check(partial) || PyTuple_GET_SIZE(partial) != 4) {
            PyErr_SetString(PyExc_TypeError, "partial must be None or a 4-tuple");
            goto done;
        }
        if (!PyArg_ParseTuple(partial, "nnnn", &ms, &mscan, &mframes, &mtotal))
            goto done;
        if (!(0 <= ms && ms <= mscan && mscan <= n && mframes >= 1 && 0 <= mtotal && mtotal <= mscan - ms)) {
            PyErr_SetString(PyExc_ValueError, "bad partial state");
            goto done;
        }
    }
    for (;;) {
        Py_ssize_t q = pos, nframes = 0, body = 0;
        unsigned long long total = 0;
        int complete = 0, is_command = 0;
        if (pos == ms) {  /* the message the last call left incomplete: on from where its scan stopped */
            q = mscan;
            nframes = mframes;
            total = (unsigned long long)mtotal;
        }
        while (q + 2 <= n) {
            unsigned char flags = p[q];
            Py_ssize_t hdr = 2;
            unsigned long long size = p[q + 1];
            if (flags & 0x02) {
                if (q + 9 > n)
                    break;
                size = read_be(p + q + 1, 8);
                hdr = 9;
            }
            zmtp_headers++;
            if (size > max_frame) {
                error = PyUnicode_FromFormat("a frame of %llu bytes (the limit is %llu)", size, max_frame);
                break;
            }
            if (flags & 0x04) {
                if (nframes) {
                    error = PyUnicode_FromString("a command among a message's frames");
                    break;
                }
                is_command = 1;
            }
            else if (nframes >= max_frames) {
                error = PyUnicode_FromFormat("a message of more than %zd frames", max_frames);
                break;
            }
            /* total <= max_message unless a caller's partial state says otherwise: no wrap either way */
            else if (total > max_message || size > max_message - total) {
                error = PyUnicode_FromFormat("a message of more than %llu bytes", max_message);
                break;
            }
            if ((unsigned long long)(n - q - hdr) < size)
                break;
            body = q + hdr;
            q += hdr + (Py_ssize_t)size;
            nframes++;
            total += size;
            if (is_command || !(flags & 0x01)) {
                complete = 1;
                break;
            }
        }
        if (error != NULL || PyErr_Occurred())
            break;
        if (!complete) {
            if (nframes && (out = Py_BuildValue("(nnnn)", pos, q, nframes, (Py_ssize_t)total)) == NULL)
                goto done;
            break;
        }
        PyObject *item = is_command ? PyBytes_FromStringAndSize((const char *)p + body, q - body)
                                    : zmtp_frames(p, n, pos, nframes);
        PyObject *end = item ? PyLong_FromSsize_t(q) : NULL;
        if (end == NULL || PyList_Append(items, item) < 0 || PyList_Append(ends, end) < 0) {
            Py_XDECREF(item);
            Py_XDECREF(end);
            goto done;
        }
        Py_DECREF(item);
        Py_DECREF(end);
        pos = q;
    }
    if (PyErr_Occurred())
        goto done;
    result = PyTuple_Pack(4, items, ends, error != NULL ? error : Py_None, out != NULL ? out : Py_None);
done:
    Py_XDECREF(error);
    Py_XDECREF(out);
    Py_XDECREF(items);
    Py_XDECREF(ends);
    PyBuffer_Release(&b);
    return result;
}

PyObject *
infera_py_zmtp_headers_read(PyObject *self, PyObject *noargs)
{
    return PyLong_FromUnsignedLongLong(zmtp_headers);
}
