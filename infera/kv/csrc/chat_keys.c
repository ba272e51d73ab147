/* chat_part_keys(): the cache keys of a chat's parts (one per message, then the generation
 * prompt) and of the whole prompt, XXH3-128 of what the template would render, computed without
 * rendering it. In C because it runs on every chat request, over every message. */
#include "xxh.h"

/* ------------------------------------------------------------------------------------------ */
/* chat_part_keys(messages, prefix, sep, suffix, generation, tag, whole_tag)                  */

static PyObject *S_role, *S_content;

static int
xxh_update_str(void *state, PyObject *str)
{
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(str, &n); /* ASCII: the str's own bytes, no copy */
    if (utf8 == NULL)
        return -1;
    infera_xxh3_128_update(state, utf8, (size_t)n);
    return 0;
}

static PyObject *
key_bytes(xxh128_t d, const char *tag, Py_ssize_t tag_len)
{
    PyObject *key = PyBytes_FromStringAndSize(NULL, 16 + tag_len);
    if (key == NULL)
        return NULL;
    unsigned char *kb = (unsigned char *)PyBytes_AS_STRING(key);
    for (int b = 0; b < 8; b++) { /* canonical: big-endian high, then low (xxhash's digest()) */
        kb[b] = (unsigned char)(d.high64 >> (56 - 8 * b));
        kb[8 + b] = (unsigned char)(d.low64 >> (56 - 8 * b));
    }
    memcpy(kb + 16, tag, (size_t)tag_len);
    return key;
}

static PyObject *
message_field(PyObject *m, PyObject *name)
{
    if (PyDict_Check(m)) {
        PyObject *v = PyDict_GetItemWithError(m, name);
        if (v == NULL && !PyErr_Occurred())
            v = Py_None;
        Py_XINCREF(v);
        return v;
    }
    PyObject *v = PyObject_GetAttr(m, name);
    if (v == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        Py_INCREF(Py_None);
        return Py_None;
    }
    return v;
}

/* The keys under which a chat rendered a message at a time (prefix + role + sep + content +
 * suffix per message, then the generation prompt) has its parts' token ids cached: XXH3-128 of
 * each part's UTF-8 (canonical digest) + tag, exactly the keys of the rendered strings, computed
 * without rendering them; the parts' lengths in characters; and the whole prompt's key, XXH3-128
 * of the parts' keys + whole_tag. None when a message is not plain
 * (a role that is not a non-empty str, content that is not a str or None, text UTF-8 cannot
 * hold) or there is none: the caller renders those itself. */
PyObject *
infera_py_chat_part_keys(PyObject *self, PyObject *args)
{
    PyObject *messages, *prefix, *sep, *suffix, *generation;
    const char *part_tag, *whole_tag;
    Py_ssize_t part_tag_len, whole_tag_len;
    if (!PyArg_ParseTuple(args, "OUUUUy#y#:chat_part_keys", &messages, &prefix, &sep, &suffix, &generation,
                          &part_tag, &part_tag_len, &whole_tag, &whole_tag_len))
        return NULL;
    PyObject *seq = PySequence_Fast(messages, "messages must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n == 0) {
        Py_DECREF(seq);
        Py_RETURN_NONE;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *keys = PyList_New(n + 1), *lengths = PyList_New(n + 1), *result = NULL;
    void *state = infera_xxh_state, *whole = infera_xxh_state_whole;
    if (keys == NULL || lengths == NULL)
        goto done;
    infera_xxh3_128_reset(whole);
    Py_ssize_t affixes = PyUnicode_GET_LENGTH(prefix) + PyUnicode_GET_LENGTH(sep) + PyUnicode_GET_LENGTH(suffix);
    for (Py_ssize_t i = 0; i <= n; i++) {
        Py_ssize_t chars;
        infera_xxh3_128_reset(state);
        if (i < n) {
            PyObject *role = message_field(items[i], S_role);
            if (role == NULL)
                goto done;
            PyObject *content = message_field(items[i], S_content);
            if (content == NULL) {
                Py_DECREF(role);
                goto done;
            }
            int plain = PyUnicode_Check(role) && PyUnicode_GET_LENGTH(role) > 0 &&
                        (content == Py_None || PyUnicode_Check(content));
            int ok = plain && xxh_update_str(state, prefix) == 0 && xxh_update_str(state, role) == 0 &&
                     xxh_update_str(state, sep) == 0 &&
                     (content == Py_None || xxh_update_str(state, content) == 0) &&
                     xxh_update_str(state, suffix) == 0;
            chars = ok ? affixes + PyUnicode_GET_LENGTH(role) +
                             (content == Py_None ? 0 : PyUnicode_GET_LENGTH(content))
                       : 0;
            Py_DECREF(role);
            Py_DECREF(content);
            if (!ok) {
                if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_UnicodeError))
                    goto done;
                PyErr_Clear();
                result = Py_None; /* not plain: the caller's */
                Py_INCREF(result);
                goto done;
            }
        }
        else {
            if (xxh_update_str(state, generation) < 0)
                goto done;
            chars = PyUnicode_GET_LENGTH(generation);
        }
        PyObject *key = key_bytes(infera_xxh3_128_digest(state), part_tag, part_tag_len);
        PyObject *len = PyLong_FromSsize_t(chars);
        if (key == NULL || len == NULL) {
            Py_XDECREF(key);
            Py_XDECREF(len);
            goto done;
        }
        infera_xxh3_128_update(whole, PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key));
        PyList_SET_ITEM(keys, i, key);
        PyList_SET_ITEM(lengths, i, len);
    }
    {
        PyObject *whole_key = key_bytes(infera_xxh3_128_digest(whole), whole_tag, whole_tag_len);
        if (whole_key != NULL)
            result = Py_BuildValue("(NOO)", whole_key, keys, lengths);
    }
done:
    Py_XDECREF(keys);
    Py_XDECREF(lengths);
    Py_DECREF(seq);
    return result;
}

int
infera_chat_keys_init(void)
{
#define INTERN(var, s)                                                                               \
    if ((var = PyUnicode_InternFromString(s)) == NULL)                                               \
        return -1;
    INTERN(S_role, "role");
    INTERN(S_content, "content");
#undef INTERN
    return 0;
}
