/* encode_builtin(): the built-in tokenizer's pieces and ids for ASCII text (infera/kv/tokenizer.py,
 * the same pieces as its bytes regex). In C because it runs per character of every prompt that
 * the built-in tokenizer encodes. */
#include "xxh.h"

/* ------------------------------------------------------------------------------------------ */
/* encode_builtin(text) -> list[int] | None                                                    */

/* The built-in tokenizer's pieces over ASCII, exactly those of its bytes pattern
 *     '(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]| ?[^\s\w]+| ?_+|\s+(?!\S)|\s+
 * (alternatives tried in order at each position; \s is [ \t\n\r\f\v], \w is [A-Za-z0-9_]), and
 * each piece's id: infera_xxh3_64(piece) % 50000 + 100. None for text that is not ASCII or that holds
 * \x1c-\x1f, which the str pattern counts as whitespace and the bytes one does not: the caller's
 * regex handles those. With ``specials``, the text is first split at the built-in special tokens
 * (their ids in its place), as BuiltinTokenizer.iter_encode splits it. */
enum { C_OTHER = 0, C_ALPHA, C_DIGIT, C_SPACE, C_UNDER, C_PUNCT };
static unsigned char char_class[128];

void
infera_tokenizer_init(void)
{
    for (int c = 0; c < 128; c++) {
        unsigned char k = C_PUNCT; /* [^\s\w] */
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
            k = C_ALPHA;
        else if (c >= '0' && c <= '9')
            k = C_DIGIT;
        else if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v')
            k = C_SPACE;
        else if (c == '_')
            k = C_UNDER;
        char_class[c] = k;
    }
}

#define BUILTIN_VOCAB 50000u
#define BUILTIN_RESERVED 100u

/* The built-in tokenizer's special tokens (BUILTIN_SPECIAL_TOKENS), for ``specials=True``. */
static const struct {
    const char *text;
    size_t len;
    unsigned long id;
} builtin_specials[] = {
    {"<|endoftext|>", 13, 0},
    {"<|im_start|>", 12, 1},
    {"<|im_end|>", 10, 2},
};

/* The first special token at or after ``from`` in s[:n] (its index in builtin_specials, and its
 * position in *at), or -1. */
static int
next_special(const unsigned char *s, Py_ssize_t from, Py_ssize_t n, Py_ssize_t *at)
{
    for (Py_ssize_t i = from; i + 1 < n; i++) {
        if (s[i] != '<' || s[i + 1] != '|')
            continue;
        for (int k = 0; k < 3; k++) {
            size_t len = builtin_specials[k].len;
            if ((size_t)(n - i) >= len && memcmp(s + i, builtin_specials[k].text, len) == 0) {
                *at = i;
                return k;
            }
        }
    }
    return -1;
}

static inline int
append_id(PyObject *out, unsigned long id)
{
    PyObject *v = PyLong_FromUnsignedLong(id);
    if (v == NULL || PyList_Append(out, v) < 0) {
        Py_XDECREF(v);
        return -1;
    }
    Py_DECREF(v);
    return 0;
}

static int encode_pieces(const unsigned char *s, Py_ssize_t i, Py_ssize_t n, PyObject *out);

PyObject *
infera_py_encode_builtin(PyObject *self, PyObject *args)
{
    PyObject *text;
    int specials = 0;
    if (!PyArg_ParseTuple(args, "U|p:encode_builtin", &text, &specials))
        return NULL;
    if (!PyUnicode_IS_ASCII(text))
        Py_RETURN_NONE;
    const unsigned char *s = PyUnicode_1BYTE_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] >= 0x1c && s[i] <= 0x1f)
            Py_RETURN_NONE;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    Py_ssize_t i = 0;
    while (specials && i < n) {
        /* the text is split at the special tokens first; each chunk between them is encoded alone */
        Py_ssize_t at;
        int k = next_special(s, i, n, &at);
        Py_ssize_t end = k < 0 ? n : at;
        if (encode_pieces(s, i, end, out) < 0 || (k >= 0 && append_id(out, builtin_specials[k].id) < 0)) {
            Py_DECREF(out);
            return NULL;
        }
        i = k < 0 ? n : at + (Py_ssize_t)builtin_specials[k].len;
    }
    if (!specials && encode_pieces(s, 0, n, out) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* s[i:n] split into pieces, each piece's id appended to ``out`` */
static int
encode_pieces(const unsigned char *s, Py_ssize_t i, Py_ssize_t n, PyObject *out)
{
    while (i < n) {
        Py_ssize_t start = i;
        unsigned char c = s[i];
        /* '(?:[sdmt]|ll|ve|re) */
        if (c == '\'' && i + 1 < n) {
            unsigned char d = s[i + 1];
            if (d == 's' || d == 'd' || d == 'm' || d == 't') {
                i += 2;
                goto emit;
            }
            if (i + 2 < n) {
                unsigned char e = s[i + 2];
                if ((d == 'l' && e == 'l') || (d == 'v' && e == 'e') || (d == 'r' && e == 'e')) {
                    i += 3;
                    goto emit;
                }
            }
        }
        {
            /* ' ?' then a class: with a leading space the class starts after it (without it, a
             * space is in none of these classes) */
            Py_ssize_t j = (c == ' ') ? i + 1 : i;
            if (j < n) {
                unsigned char k = char_class[s[j]];
                if (k == C_ALPHA || k == C_PUNCT || k == C_UNDER) { /* runs */
                    while (j < n && char_class[s[j]] == k)
                        j++;
                    i = j;
                    goto emit;
                }
                if (k == C_DIGIT) { /* one digit */
                    i = j + 1;
                    goto emit;
                }
            }
        }
        /* \s+(?!\S) | \s+ : a whitespace run, less its last character when a non-space follows
         * and the run is longer than one */
        {
            Py_ssize_t j = i;
            while (j < n && char_class[s[j]] == C_SPACE)
                j++;
            if (j < n && j - i >= 2)
                j--;
            i = j;
        }
    emit:
        if (i == start) { /* cannot happen for ASCII: every character is in one class */
            PyErr_SetString(PyExc_RuntimeError, "encode_builtin: no progress");
            return -1;
        }
        if (append_id(out, (unsigned long)(infera_xxh3_64(s + start, (size_t)(i - start)) % BUILTIN_VOCAB +
                                           BUILTIN_RESERVED)) < 0)
            return -1;
    }
    return 0;
}
