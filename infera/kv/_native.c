/* infera.kv._native: the kv-aware router's per-block and per-token loops in C.
 *
 * What runs here is what bench/kv_routing.py --attribute found to cost most per request in the
 * server, all of it work per block or per token that the interpreter did one bytecode at a time:
 *
 *   - block_hashes():   chained XXH3-64 over full blocks (infera/kv/hashing.py);
 *   - prefix_keys():    the BlockHashCache's XXH3-128 digests of a prompt's prefixes;
 *   - encode_builtin(): the built-in tokenizer's pieces and ids for ASCII text
 *                       (infera/kv/tokenizer.py, the same pieces as its bytes regex);
 *   - GpuView:          the index's GPU view (infera/kv/index.py): router hash -> holder bits, and
 *                       per target engine hash -> router hash, in open-addressing tables of plain
 *                       integers (a walk over a prompt's blocks touches a few cache lines, not a
 *                       dict entry and two int objects per block), with event application and
 *                       the prefix matches;
 *   - BlockCounter:     a multiset of block hashes (the policy's blocks in flight per target).
 *
 * XXH3 comes from the xxhash package's own compiled library: its extension module exports the
 * XXH3_* symbols, found here with dlsym, so every hash is the one infera's Python code computes
 * with the same package (checked at import). When they cannot be found the import fails and the
 * Python implementations run instead (infera/kv/native.py).
 *
 * Every function holds the GIL throughout: the tables are read from tokenizer threads too (the
 * horizon's checks), and no call can interleave with another.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && (__BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__)
#error "infera.kv._native assumes a little-endian machine (token ids and hashes are hashed as LE bytes)"
#endif

/* ------------------------------------------------------------------------------------------ */
/* xxHash, from the xxhash package's library                                                  */

typedef struct { uint64_t low64, high64; } xxh128_t;
typedef uint64_t (*xxh3_64_fn)(const void *, size_t);
typedef uint64_t (*xxh3_64_seed_fn)(const void *, size_t, uint64_t);
typedef void *(*xxh3_create_fn)(void);
typedef int (*xxh3_reset_fn)(void *);
typedef int (*xxh3_update_fn)(void *, const void *, size_t);
typedef xxh128_t (*xxh3_digest128_fn)(const void *);

static xxh3_64_fn XXH3_64;
static xxh3_64_seed_fn XXH3_64_seed;
static xxh3_create_fn XXH3_create;
static xxh3_reset_fn XXH3_128_reset;
static xxh3_update_fn XXH3_128_update;
static xxh3_digest128_fn XXH3_128_digest;
/* Two streaming states made once (a state is ~600 bytes, aligned: malloc'd per call it cost more than
 * hashing a short prompt). Every user holds the GIL and none calls back into Python while using one. */
static void *xxh_state, *xxh_state_whole;

static int
load_xxhash(void)
{
    PyObject *mod = PyImport_ImportModule("xxhash._xxhash");
    if (mod == NULL)
        return -1;
    PyObject *file = PyObject_GetAttrString(mod, "__file__");
    Py_DECREF(mod);
    if (file == NULL)
        return -1;
    const char *path = PyUnicode_AsUTF8(file);
    if (path == NULL) {
        Py_DECREF(file);
        return -1;
    }
    /* already loaded by the import above: this only finds its handle */
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(file);
    if (lib == NULL) {
        PyErr_Format(PyExc_ImportError, "cannot find xxhash's library: %s", dlerror());
        return -1;
    }
#define SYM(var, type, name)                                                                         \
    var = (type)dlsym(lib, name);                                                                    \
    if (var == NULL) {                                                                               \
        PyErr_SetString(PyExc_ImportError, "xxhash's library does not export " name);                \
        return -1;                                                                                   \
    }
    SYM(XXH3_64, xxh3_64_fn, "XXH3_64bits");
    SYM(XXH3_64_seed, xxh3_64_seed_fn, "XXH3_64bits_withSeed");
    SYM(XXH3_create, xxh3_create_fn, "XXH3_createState");
    SYM(XXH3_128_reset, xxh3_reset_fn, "XXH3_128bits_reset");
    SYM(XXH3_128_update, xxh3_update_fn, "XXH3_128bits_update");
    SYM(XXH3_128_digest, xxh3_digest128_fn, "XXH3_128bits_digest");
#undef SYM
    xxh_state = XXH3_create();
    xxh_state_whole = XXH3_create();
    if (xxh_state == NULL || xxh_state_whole == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

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
static int
u32_tokens(PyObject *obj, Py_ssize_t limit, U32Tokens *t)
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

static void
u32_release(U32Tokens *t)
{
    if (t->has_view)
        PyBuffer_Release(&t->view);
    PyMem_Free(t->owned);
    t->owned = NULL;
    t->has_view = 0;
}

/* Chained block hashes: out[i] = XXH3_64(parent_i as u64 LE ++ block i's ids as u32 LE), parent_0 =
 * ``parent``, parent_{i+1} = out[i]. ``scratch`` holds 8 + 4 * block_size bytes. */
static void
chain_hashes(const uint32_t *ids, Py_ssize_t nblocks, Py_ssize_t block_size, uint64_t parent,
             unsigned char *scratch, uint64_t *out)
{
    size_t span = (size_t)block_size * 4;
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        memcpy(scratch, &parent, 8);
        memcpy(scratch + 8, ids + i * block_size, span);
        parent = XXH3_64(scratch, 8 + span);
        out[i] = parent;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* block_hashes(tokens, block_size, parent=0) -> list[int]                                     */

static PyObject *
py_block_hashes(PyObject *self, PyObject *args)
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
    if (u32_tokens(tokens, len - len % block_size, &t) < 0)
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
static PyObject *
py_block_hash_bytes(PyObject *self, PyObject *args)
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
    if (u32_tokens(tokens, len - len % block_size, &t) < 0)
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
static PyObject *
py_prefix_keys(PyObject *self, PyObject *args)
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
    state = xxh_state;
    XXH3_128_reset(state);
    const char *p = data.buf;
    for (Py_ssize_t k = 0; k < nkeys; k++) {
        XXH3_128_update(state, p + k * stride, (size_t)stride);
        xxh128_t d = XXH3_128_digest(state);
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
    XXH3_128_update(state, utf8, (size_t)n);
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
static PyObject *
py_chat_part_keys(PyObject *self, PyObject *args)
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
    void *state = xxh_state, *whole = xxh_state_whole;
    if (keys == NULL || lengths == NULL)
        goto done;
    XXH3_128_reset(whole);
    Py_ssize_t affixes = PyUnicode_GET_LENGTH(prefix) + PyUnicode_GET_LENGTH(sep) + PyUnicode_GET_LENGTH(suffix);
    for (Py_ssize_t i = 0; i <= n; i++) {
        Py_ssize_t chars;
        XXH3_128_reset(state);
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
        PyObject *key = key_bytes(XXH3_128_digest(state), part_tag, part_tag_len);
        PyObject *len = PyLong_FromSsize_t(chars);
        if (key == NULL || len == NULL) {
            Py_XDECREF(key);
            Py_XDECREF(len);
            goto done;
        }
        XXH3_128_update(whole, PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key));
        PyList_SET_ITEM(keys, i, key);
        PyList_SET_ITEM(lengths, i, len);
    }
    {
        PyObject *whole_key = key_bytes(XXH3_128_digest(whole), whole_tag, whole_tag_len);
        if (whole_key != NULL)
            result = Py_BuildValue("(NOO)", whole_key, keys, lengths);
    }
done:
    Py_XDECREF(keys);
    Py_XDECREF(lengths);
    Py_DECREF(seq);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* encode_builtin(text) -> list[int] | None                                                    */

/* The built-in tokenizer's pieces over ASCII, exactly those of its bytes pattern
 *     '(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]| ?[^\s\w]+| ?_+|\s+(?!\S)|\s+
 * (alternatives tried in order at each position; \s is [ \t\n\r\f\v], \w is [A-Za-z0-9_]), and
 * each piece's id: XXH3_64(piece) % 50000 + 100. None for text that is not ASCII or that holds
 * \x1c-\x1f, which the str pattern counts as whitespace and the bytes one does not: the caller's
 * regex handles those. With ``specials``, the text is first split at the built-in special tokens
 * (their ids in its place), as BuiltinTokenizer.iter_encode splits it. */
enum { C_OTHER = 0, C_ALPHA, C_DIGIT, C_SPACE, C_UNDER, C_PUNCT };
static unsigned char char_class[128];

static void
init_char_class(void)
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

static int
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

static PyObject *
py_encode_builtin(PyObject *self, PyObject *args)
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
        if (append_id(out, (unsigned long)(XXH3_64(s + start, (size_t)(i - start)) % BUILTIN_VOCAB +
                                           BUILTIN_RESERVED)) < 0)
            return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* open-addressing tables of u64 keys (linear probing, backward-shift deletion)                */

#define GOLDEN 0x9E3779B97F4A7C15ULL

static inline uint64_t
home_of(uint64_t key, int shift)
{
    return (key * GOLDEN) >> shift;
}

/* key -> u64 value; used[] marks the occupied slots (any key, 0 included, is valid) */
typedef struct {
    uint64_t *keys;
    uint64_t *vals;
    uint8_t *used;
    uint64_t cap; /* 0 or a power of two */
    uint64_t n;
    int shift;
} Map64;

static void
map_free(Map64 *m)
{
    PyMem_Free(m->keys);
    PyMem_Free(m->vals);
    PyMem_Free(m->used);
    memset(m, 0, sizeof(*m));
}

static int
map_alloc(Map64 *m, uint64_t cap)
{
    int bits = 0;
    while ((1ULL << bits) < cap)
        bits++;
    m->keys = PyMem_Malloc(cap * sizeof(uint64_t));
    m->vals = PyMem_Malloc(cap * sizeof(uint64_t));
    m->used = PyMem_Calloc(cap, 1);
    if (m->keys == NULL || m->vals == NULL || m->used == NULL) {
        map_free(m);
        PyErr_NoMemory();
        return -1;
    }
    m->cap = cap;
    m->n = 0;
    m->shift = 64 - bits;
    return 0;
}

static inline int64_t
map_find(const Map64 *m, uint64_t key)
{
    if (m->cap == 0)
        return -1;
    uint64_t mask = m->cap - 1;
    uint64_t i = home_of(key, m->shift);
    while (m->used[i]) {
        if (m->keys[i] == key)
            return (int64_t)i;
        i = (i + 1) & mask;
    }
    return -1;
}

static int map_put(Map64 *m, uint64_t key, uint64_t val);

static int
map_grow(Map64 *m)
{
    Map64 old = *m;
    if (map_alloc(m, old.cap ? old.cap * 2 : 16) < 0) {
        *m = old;
        return -1;
    }
    for (uint64_t i = 0; i < old.cap; i++) {
        if (old.used[i])
            map_put(m, old.keys[i], old.vals[i]);
    }
    map_free(&old);
    return 0;
}

/* insert or overwrite */
static int
map_put(Map64 *m, uint64_t key, uint64_t val)
{
    if ((m->n + 1) * 4 > m->cap * 3 && map_grow(m) < 0)
        return -1;
    uint64_t mask = m->cap - 1;
    uint64_t i = home_of(key, m->shift);
    while (m->used[i]) {
        if (m->keys[i] == key) {
            m->vals[i] = val;
            return 0;
        }
        i = (i + 1) & mask;
    }
    m->used[i] = 1;
    m->keys[i] = key;
    m->vals[i] = val;
    m->n++;
    return 0;
}

static void
map_delete_at(Map64 *m, uint64_t i)
{
    uint64_t mask = m->cap - 1;
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!m->used[j])
            break;
        uint64_t k = home_of(m->keys[j], m->shift);
        /* move j back to the hole at i unless its home lies cyclically in (i, j] */
        int stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            m->keys[i] = m->keys[j];
            m->vals[i] = m->vals[j];
            i = j;
        }
    }
    m->used[i] = 0;
    m->n--;
}

static inline int
map_pop(Map64 *m, uint64_t key, uint64_t *val)
{
    int64_t i = map_find(m, key);
    if (i < 0)
        return 0;
    *val = m->vals[i];
    map_delete_at(m, (uint64_t)i);
    return 1;
}

/* router hash -> holder bits (``words`` u64 words per entry); an entry with no bit is no entry */
typedef struct {
    uint64_t *slots; /* cap * (1 + words): key, then the bit words */
    uint64_t cap;
    uint64_t n;
    int shift;
    int words;
} Holders;

#define H_STRIDE(h) ((uint64_t)(1 + (h)->words))

static inline int
h_empty(const Holders *h, const uint64_t *slot)
{
    for (int w = 1; w <= h->words; w++) {
        if (slot[w])
            return 0;
    }
    return 1;
}

static int
h_alloc(Holders *h, uint64_t cap, int words)
{
    int bits = 0;
    while ((1ULL << bits) < cap)
        bits++;
    h->slots = PyMem_Calloc(cap * (uint64_t)(1 + words), sizeof(uint64_t));
    if (h->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    h->cap = cap;
    h->n = 0;
    h->shift = 64 - bits;
    h->words = words;
    return 0;
}

/* the slot of ``key``, or NULL */
static inline uint64_t *
h_find(const Holders *h, uint64_t key)
{
    uint64_t mask = h->cap - 1, stride = H_STRIDE(h);
    uint64_t i = home_of(key, h->shift);
    for (;;) {
        uint64_t *slot = h->slots + i * stride;
        if (h_empty(h, slot))
            return NULL;
        if (slot[0] == key)
            return slot;
        i = (i + 1) & mask;
    }
}

/* the slot of ``key``, inserted empty if absent (the caller sets a bit at once) */
static uint64_t *h_slot_for(Holders *h, uint64_t key);

static int
h_rebuild(Holders *h, uint64_t cap, int words)
{
    Holders old = *h;
    if (h_alloc(h, cap, words) < 0) {
        *h = old;
        return -1;
    }
    uint64_t ostride = H_STRIDE(&old), nstride = H_STRIDE(h);
    for (uint64_t i = 0; i < old.cap; i++) {
        uint64_t *src = old.slots + i * ostride;
        if (h_empty(&old, src))
            continue;
        /* insert directly: the new table has room and no copy of the key */
        uint64_t mask = h->cap - 1, j = home_of(src[0], h->shift);
        while (!h_empty(h, h->slots + j * nstride))
            j = (j + 1) & mask;
        uint64_t *dst = h->slots + j * nstride;
        dst[0] = src[0];
        memcpy(dst + 1, src + 1, (size_t)old.words * sizeof(uint64_t));
        h->n++;
    }
    PyMem_Free(old.slots);
    return 0;
}

static uint64_t *
h_slot_for(Holders *h, uint64_t key)
{
    if ((h->n + 1) * 4 > h->cap * 3 && h_rebuild(h, h->cap * 2, h->words) < 0)
        return NULL;
    uint64_t mask = h->cap - 1, stride = H_STRIDE(h);
    uint64_t i = home_of(key, h->shift);
    for (;;) {
        uint64_t *slot = h->slots + i * stride;
        if (h_empty(h, slot)) {
            slot[0] = key;
            h->n++;
            return slot;
        }
        if (slot[0] == key)
            return slot;
        i = (i + 1) & mask;
    }
}

static void
h_delete(Holders *h, uint64_t *slot)
{
    uint64_t mask = h->cap - 1, stride = H_STRIDE(h);
    uint64_t i = (uint64_t)(slot - h->slots) / stride;
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        uint64_t *sj = h->slots + j * stride;
        if (h_empty(h, sj))
            break;
        uint64_t k = home_of(sj[0], h->shift);
        int stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            memcpy(h->slots + i * stride, sj, stride * sizeof(uint64_t));
            i = j;
        }
    }
    memset(h->slots + i * stride, 0, stride * sizeof(uint64_t));
    h->n--;
}

/* 1: the bit was newly set; 0: it was set already; -1: out of memory */
static inline int
h_set_bit(Holders *h, uint64_t key, int bit)
{
    uint64_t *slot = h_slot_for(h, key);
    if (slot == NULL)
        return -1;
    uint64_t b = 1ULL << (bit & 63);
    uint64_t *word = slot + 1 + (bit >> 6);
    if (*word & b)
        return 0;
    *word |= b;
    return 1;
}

/* 1: the bit was set and is cleared (the entry goes with its last bit); 0: it was not set */
static inline int
h_clear_bit(Holders *h, uint64_t key, int bit)
{
    uint64_t *slot = h_find(h, key);
    if (slot == NULL)
        return 0;
    uint64_t b = 1ULL << (bit & 63);
    uint64_t *word = slot + 1 + (bit >> 6);
    if (!(*word & b))
        return 0;
    *word &= ~b;
    if (h_empty(h, slot))
        h_delete(h, slot);
    return 1;
}

static inline int
h_has_bit(const Holders *h, uint64_t key, int bit)
{
    uint64_t *slot = h_find(h, key);
    return slot != NULL && (slot[1 + (bit >> 6)] >> (bit & 63)) & 1;
}

/* ------------------------------------------------------------------------------------------ */
/* GpuView                                                                                     */

/* Counters of one apply() or apply_payload() call. */
typedef struct {
    Py_ssize_t stored_events, stored_blocks, removed_events, removed_blocks;
    Py_ssize_t dropped_events, skipped_events, misaligned_events, other_block_size;
} ApplyCounts;

/* The event counters a target's applies accumulate (TargetStats' fields of the same names). */
enum { C_STORED_EVENTS, C_STORED_BLOCKS, C_REMOVED_EVENTS, C_REMOVED_BLOCKS, C_DROPPED, C_SKIPPED, C_MISALIGNED,
       N_COUNTERS };

typedef struct {
    Map64 emap;         /* engine hash (folded to u64) -> router hash */
    Py_ssize_t count;   /* router hashes whose entry has this target's bit */
    int unmapped;       /* the view may hold router hashes no emap value names */
    int live;
    Py_ssize_t counters[N_COUNTERS];
} Target;

typedef struct {
    PyObject_HEAD
    Holders holders;
    Target *targets; /* by bit */
    Py_ssize_t ntargets;
    PyObject *stored_type, *removed_type, *cleared_type, *full_kinds;
} GpuView;

static PyObject *S_block_hashes, *S_parent, *S_token_ids, *S_block_size, *S_spec_kind, *S_medium;

/* An engine hash as a u64 key: an int as its 64-bit two's complement (engines send unsigned or
 * signed 64-bit ints, one kind each), anything else (vLLM's bytes digests) folded with a seeded
 * XXH3, as vLLM itself folds a digest to 64 bits for its int hashes. */
#define FOLD_SEED_BYTES 0x6b76766965775f62ULL
#define FOLD_SEED_OTHER 0x6b76766965775f6fULL

static int
engine_key(PyObject *obj, uint64_t *out)
{
    if (PyLong_CheckExact(obj) || PyLong_Check(obj)) {
        unsigned long long v = PyLong_AsUnsignedLongLong(obj);
        if (!(v == (unsigned long long)-1 && PyErr_Occurred())) {
            *out = v;
            return 0;
        }
        PyErr_Clear();
        long long s = PyLong_AsLongLong(obj);
        if (!(s == -1 && PyErr_Occurred())) {
            *out = (uint64_t)s;
            return 0;
        }
        PyErr_Clear();
        /* wider than 64 bits (not from a decoder): its hash */
    }
    if (PyBytes_Check(obj)) {
        *out = XXH3_64_seed(PyBytes_AS_STRING(obj), (size_t)PyBytes_GET_SIZE(obj), FOLD_SEED_BYTES);
        return 0;
    }
    Py_hash_t hv = PyObject_Hash(obj);
    if (hv == -1 && PyErr_Occurred())
        return -1;
    uint64_t x = (uint64_t)hv;
    *out = XXH3_64_seed(&x, 8, FOLD_SEED_OTHER);
    return 0;
}

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

static int
hashes_get(PyObject *obj, Hashes *h)
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

static void
hashes_release(Hashes *h)
{
    if (h->has_view)
        PyBuffer_Release(&h->view);
    Py_XDECREF(h->seq);
    h->seq = NULL;
    h->has_view = 0;
}

static int
view_ensure(GpuView *v, int bit)
{
    if (bit >= v->ntargets) {
        Py_ssize_t n = v->ntargets ? v->ntargets : 8;
        while (n <= bit)
            n *= 2;
        Target *t = PyMem_Realloc(v->targets, (size_t)n * sizeof(Target));
        if (t == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memset(t + v->ntargets, 0, (size_t)(n - v->ntargets) * sizeof(Target));
        v->targets = t;
        v->ntargets = n;
    }
    int words = (bit >> 6) + 1;
    if (words > v->holders.words && h_rebuild(&v->holders, v->holders.cap, words) < 0)
        return -1;
    return 0;
}

static int
parse_bit(GpuView *v, PyObject *obj, int *bit)
{
    long b = PyLong_AsLong(obj);
    if (b == -1 && PyErr_Occurred())
        return -1;
    if (b < 0 || b >= v->ntargets || !v->targets[b].live) {
        PyErr_Format(PyExc_KeyError, "no target with bit %ld", b);
        return -1;
    }
    *bit = (int)b;
    return 0;
}

static int
GpuView_init(GpuView *v, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"stored", "removed", "cleared", "full_attention_kinds", NULL};
    PyObject *stored, *removed, *cleared, *kinds;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO:GpuView", kwlist, &stored, &removed, &cleared, &kinds))
        return -1;
    if (!PyType_Check(stored) || !PyType_Check(removed) || !PyType_Check(cleared) || !PyAnySet_Check(kinds)) {
        PyErr_SetString(PyExc_TypeError, "GpuView(stored, removed, cleared: types, full_attention_kinds: set)");
        return -1;
    }
    if (v->holders.slots == NULL && h_alloc(&v->holders, 64, 1) < 0)
        return -1;
    Py_INCREF(stored);
    Py_XSETREF(v->stored_type, stored);
    Py_INCREF(removed);
    Py_XSETREF(v->removed_type, removed);
    Py_INCREF(cleared);
    Py_XSETREF(v->cleared_type, cleared);
    Py_INCREF(kinds);
    Py_XSETREF(v->full_kinds, kinds);
    return 0;
}

static void
GpuView_dealloc(GpuView *v)
{
    for (Py_ssize_t i = 0; i < v->ntargets; i++)
        map_free(&v->targets[i].emap);
    PyMem_Free(v->targets);
    PyMem_Free(v->holders.slots);
    Py_XDECREF(v->stored_type);
    Py_XDECREF(v->removed_type);
    Py_XDECREF(v->cleared_type);
    Py_XDECREF(v->full_kinds);
    Py_TYPE(v)->tp_free((PyObject *)v);
}

/* add(bit): a new target, empty */
static PyObject *
GpuView_add(GpuView *v, PyObject *arg)
{
    long b = PyLong_AsLong(arg);
    if (b == -1 && PyErr_Occurred())
        return NULL;
    if (b < 0 || b > (1 << 20)) {
        PyErr_SetString(PyExc_ValueError, "bit out of range");
        return NULL;
    }
    if (view_ensure(v, (int)b) < 0)
        return NULL;
    Target *t = &v->targets[b];
    if (t->live) {
        PyErr_Format(PyExc_ValueError, "bit %ld is in use", b);
        return NULL;
    }
    map_free(&t->emap);
    t->count = 0;
    t->unmapped = 0;
    t->live = 1;
    memset(t->counters, 0, sizeof(t->counters));
    Py_RETURN_NONE;
}

/* Empty a target's view and map (its bit stays). */
static void
view_drop(GpuView *v, int bit)
{
    Target *t = &v->targets[bit];
    Holders *h = &v->holders;
    if (t->count && !t->unmapped) {
        /* every viewed hash was added with a map entry: clear through the map */
        for (uint64_t i = 0; i < t->emap.cap && t->count; i++) {
            if (t->emap.used[i] && h_clear_bit(h, t->emap.vals[i], bit))
                t->count--;
        }
    }
    if (t->count) {
        /* misaligned events (or a remapped engine hash) left hashes no map entry names: scan, then
         * rebuild without the entries left empty */
        uint64_t stride = H_STRIDE(h), b = 1ULL << (bit & 63);
        int emptied = 0;
        for (uint64_t i = 0; i < h->cap; i++) {
            uint64_t *slot = h->slots + i * stride;
            if (h_empty(h, slot))
                continue;
            slot[1 + (bit >> 6)] &= ~b;
            if (h_empty(h, slot))
                emptied = 1;
        }
        if (emptied) {
            /* an emptied slot reads as free, which would break probe chains: re-insert the rest */
            Holders old = *h;
            if (h_alloc(h, old.cap, old.words) == 0) {
                for (uint64_t i = 0; i < old.cap; i++) {
                    uint64_t *src = old.slots + i * stride;
                    if (h_empty(&old, src))
                        continue;
                    uint64_t mask = h->cap - 1, j = home_of(src[0], h->shift);
                    while (!h_empty(h, h->slots + j * stride))
                        j = (j + 1) & mask;
                    memcpy(h->slots + j * stride, src, stride * sizeof(uint64_t));
                    h->n++;
                }
                PyMem_Free(old.slots);
            }
            else {
                /* no memory for the copy: recount in place (the chains may break: rebuild later) */
                *h = old;
                PyErr_Clear();
                uint64_t n = 0;
                for (uint64_t i = 0; i < h->cap; i++)
                    n += !h_empty(h, h->slots + i * stride);
                h->n = n;
            }
        }
    }
    t->count = 0;
    map_free(&t->emap);
    t->unmapped = 0;
}

static PyObject *
GpuView_drop(GpuView *v, PyObject *arg)
{
    int bit;
    if (parse_bit(v, arg, &bit) < 0)
        return NULL;
    view_drop(v, bit);
    Py_RETURN_NONE;
}

/* remove(bit): drop the view and free the bit */
static PyObject *
GpuView_remove(GpuView *v, PyObject *arg)
{
    int bit;
    if (parse_bit(v, arg, &bit) < 0)
        return NULL;
    view_drop(v, bit);
    v->targets[bit].live = 0;
    Py_RETURN_NONE;
}

static PyObject *
GpuView_count(GpuView *v, PyObject *arg)
{
    int bit;
    if (parse_bit(v, arg, &bit) < 0)
        return NULL;
    return PyLong_FromSsize_t(v->targets[bit].count);
}

/* counts(bits) -> [count(bit) for bit in bits], 0 for a bit that is no live target (-1: unknown key) */
static PyObject *
GpuView_counts(GpuView *v, PyObject *bits)
{
    if (!PyList_Check(bits)) {
        PyErr_SetString(PyExc_TypeError, "counts() takes a list of bits");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(bits);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        long b = PyLong_AsLong(PyList_GET_ITEM(bits, i));
        if (b == -1 && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        Py_ssize_t c = (b >= 0 && b < v->ntargets && v->targets[b].live) ? v->targets[b].count : 0;
        PyObject *x = PyLong_FromSsize_t(c);
        if (x == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, x);
    }
    return out;
}

static PyObject *
GpuView_mapped(GpuView *v, PyObject *arg)
{
    int bit;
    if (parse_bit(v, arg, &bit) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(v->targets[bit].emap.n);
}

/* counters(bit) -> (stored_events, stored_blocks, removed_events, removed_blocks, dropped_events,
 * skipped_events, misaligned_events) since the target was added */
static PyObject *
GpuView_counters(GpuView *v, PyObject *arg)
{
    int bit;
    if (parse_bit(v, arg, &bit) < 0)
        return NULL;
    Py_ssize_t *c = v->targets[bit].counters;
    return Py_BuildValue("(nnnnnnn)", c[0], c[1], c[2], c[3], c[4], c[5], c[6]);
}

static void
add_counts(Target *t, const ApplyCounts *c)
{
    t->counters[C_STORED_EVENTS] += c->stored_events;
    t->counters[C_STORED_BLOCKS] += c->stored_blocks;
    t->counters[C_REMOVED_EVENTS] += c->removed_events;
    t->counters[C_REMOVED_BLOCKS] += c->removed_blocks;
    t->counters[C_DROPPED] += c->dropped_events;
    t->counters[C_SKIPPED] += c->skipped_events;
    t->counters[C_MISALIGNED] += c->misaligned_events;
}

static Py_ssize_t
GpuView_len(GpuView *v)
{
    return (Py_ssize_t)v->holders.n;
}

/* holds(bit, router_hash) -> bool */
static PyObject *
GpuView_holds(GpuView *v, PyObject *args)
{
    PyObject *bobj, *hobj;
    int bit;
    uint64_t key;
    if (!PyArg_ParseTuple(args, "OO:holds", &bobj, &hobj) || parse_bit(v, bobj, &bit) < 0)
        return NULL;
    if (router_key(hobj, &key) < 0)
        Py_RETURN_FALSE;
    return PyBool_FromLong(h_has_bit(&v->holders, key, bit));
}

/* emap_get(bit, engine_hash) -> router hash | None */
static PyObject *
GpuView_emap_get(GpuView *v, PyObject *args)
{
    PyObject *bobj, *eobj;
    int bit;
    uint64_t key;
    if (!PyArg_ParseTuple(args, "OO:emap_get", &bobj, &eobj) || parse_bit(v, bobj, &bit) < 0)
        return NULL;
    if (engine_key(eobj, &key) < 0)
        return NULL;
    int64_t i = map_find(&v->targets[bit].emap, key);
    if (i < 0)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(v->targets[bit].emap.vals[i]);
}

/* first_unheld(hashes, start=0) -> position of the first of hashes[start:] no target holds */
static PyObject *
GpuView_first_unheld(GpuView *v, PyObject *args)
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
    if (hashes_get(hashes, &hs) < 0)
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
static PyObject *
GpuView_match_one(GpuView *v, PyObject *args)
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
    if (hashes_get(hashes, &hs) < 0)
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
static PyObject *
GpuView_match(GpuView *v, PyObject *args)
{
    PyObject *hashes, *bits_obj;
    if (!PyArg_ParseTuple(args, "OO:match", &hashes, &bits_obj))
        return NULL;
    PyObject *bseq = PySequence_Fast(bits_obj, "bits must be a sequence");
    if (bseq == NULL)
        return NULL;
    Hashes hs;
    if (hashes_get(hashes, &hs) < 0) {
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

/* The bytes one block is hashed from (8 + 4 * block_size): on the stack up to 64-token blocks. */
typedef struct {
    unsigned char stack[8 + 4 * 64];
    unsigned char *heap;
    Py_ssize_t heap_len;
} Scratch;

static unsigned char *
scratch_get(Scratch *s, Py_ssize_t need)
{
    if (need <= (Py_ssize_t)sizeof(s->stack))
        return s->stack;
    if (need > s->heap_len) {
        unsigned char *b = PyMem_Realloc(s->heap, (size_t)need);
        if (b == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        s->heap = b;
        s->heap_len = need;
    }
    return s->heap;
}


/* 1 when ``medium`` names the GPU tier (None, or "GPU" in any case), 0 when a lower tier (or an
 * unusual spelling the caller's lower_tier() decides), -1 on error */
static int
is_gpu_medium(PyObject *medium)
{
    if (medium == Py_None)
        return 1;
    if (!PyUnicode_Check(medium) || !PyUnicode_IS_ASCII(medium) || PyUnicode_GET_LENGTH(medium) != 3)
        return 0;
    const unsigned char *s = PyUnicode_1BYTE_DATA(medium);
    return (s[0] | 0x20) == 'g' && (s[1] | 0x20) == 'p' && (s[2] | 0x20) == 'u';
}

/* Apply one GPU BlockRemoved. */
static int
apply_removed(GpuView *v, int bit, PyObject *ev, ApplyCounts *c)
{
    PyObject *ehs = PyObject_GetAttr(ev, S_block_hashes);
    if (ehs == NULL)
        return -1;
    PyObject *seq = PySequence_Fast(ehs, "block_hashes must be a sequence");
    Py_DECREF(ehs);
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Target *t = &v->targets[bit];
    c->removed_events++;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key, h;
        if (engine_key(items[i], &key) < 0) {
            Py_DECREF(seq);
            return -1;
        }
        if (!map_pop(&t->emap, key, &h))
            continue;
        c->removed_blocks++;
        if (h_clear_bit(&v->holders, h, bit))
            t->count--;
    }
    Py_DECREF(seq);
    return 0;
}

/* Apply one GPU BlockStored: its blocks re-hashed in the router's space, chained from its parent's
 * router hash, entered in the view and mapped from their engine hashes. 1 when done, 0 when the
 * caller must apply it itself (its parent is unknown here but the target has lower tiers, whose
 * maps live in Python), -1 on error. */
static int
apply_stored(GpuView *v, int bit, Py_ssize_t bs, PyObject *ev, PyObject *lower_parent, ApplyCounts *c,
             Scratch *scratch)
{
    PyObject *kind = PyObject_GetAttr(ev, S_spec_kind);
    if (kind == NULL)
        return -1;
    if (kind != Py_None) {
        int full = PySet_Contains(v->full_kinds, kind);
        Py_DECREF(kind);
        if (full < 0)
            return -1;
        if (!full) {
            c->skipped_events++;
            return 1;
        }
    }
    else {
        Py_DECREF(kind);
    }
    Target *t = &v->targets[bit];
    uint64_t h = 0; /* ROUTER_SEED */
    PyObject *parent = PyObject_GetAttr(ev, S_parent);
    if (parent == NULL)
        return -1;
    if (parent != Py_None) {
        uint64_t pkey;
        if (engine_key(parent, &pkey) < 0) {
            Py_DECREF(parent);
            return -1;
        }
        int64_t at = map_find(&t->emap, pkey);
        if (at >= 0) {
            h = t->emap.vals[at];
        }
        else if (lower_parent != Py_None) {
            /* a block loaded back from a lower tier: its parent may be there */
            PyObject *r = PyObject_CallOneArg(lower_parent, parent);
            if (r == NULL) {
                Py_DECREF(parent);
                return -1;
            }
            if (r == Py_None) {
                Py_DECREF(r);
                Py_DECREF(parent);
                c->dropped_events++;
                return 1;
            }
            unsigned long long rv = PyLong_AsUnsignedLongLong(r);
            Py_DECREF(r);
            if (rv == (unsigned long long)-1 && PyErr_Occurred()) {
                Py_DECREF(parent);
                return -1;
            }
            h = rv;
            t = &v->targets[bit];
        }
        else {
            Py_DECREF(parent);
            c->dropped_events++;
            return 1;
        }
    }
    Py_DECREF(parent);
    PyObject *ev_bs = PyObject_GetAttr(ev, S_block_size);
    if (ev_bs == NULL)
        return -1;
    long evbs = PyLong_AsLong(ev_bs);
    Py_DECREF(ev_bs);
    if (evbs == -1 && PyErr_Occurred())
        PyErr_Clear();
    if (evbs != bs && c->other_block_size == 0)
        c->other_block_size = evbs ? evbs : -1;
    PyObject *tokens = PyObject_GetAttr(ev, S_token_ids);
    if (tokens == NULL)
        return -1;
    U32Tokens tk;
    if (u32_tokens(tokens, -1, &tk) < 0) { /* all of them: a bad id anywhere drops the event */
        Py_DECREF(tokens);
        if (!PyErr_ExceptionMatches(PyExc_OverflowError) && !PyErr_ExceptionMatches(PyExc_TypeError))
            return -1;
        PyErr_Clear();
        c->dropped_events++;
        return 1;
    }
    Py_DECREF(tokens);
    PyObject *ehs = PyObject_GetAttr(ev, S_block_hashes);
    PyObject *eseq = ehs ? PySequence_Fast(ehs, "block_hashes must be a sequence") : NULL;
    Py_XDECREF(ehs);
    if (eseq == NULL) {
        u32_release(&tk);
        return -1;
    }
    Py_ssize_t nblocks = tk.n / bs, nhashes = PySequence_Fast_GET_SIZE(eseq);
    PyObject **eitems = PySequence_Fast_ITEMS(eseq);
    c->stored_events++;
    c->stored_blocks += nblocks;
    unsigned char *buf = scratch_get(scratch, 8 + bs * 4);
    if (buf == NULL) {
        u32_release(&tk);
        Py_DECREF(eseq);
        return -1;
    }
    size_t span = (size_t)bs * 4;
    int aligned = nblocks == nhashes;
    if (!aligned) {
        c->misaligned_events++;
        if (nblocks)
            t->unmapped = 1;
    }
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        memcpy(buf, &h, 8);
        memcpy(buf + 8, tk.ids + i * bs, span);
        h = XXH3_64(buf, 8 + span);
        if (aligned) {
            uint64_t ekey;
            if (engine_key(eitems[i], &ekey) < 0 || map_put(&t->emap, ekey, h) < 0) {
                u32_release(&tk);
                Py_DECREF(eseq);
                return -1;
            }
        }
        int set = h_set_bit(&v->holders, h, bit);
        if (set < 0) {
            u32_release(&tk);
            Py_DECREF(eseq);
            return -1;
        }
        t->count += set;
    }
    u32_release(&tk);
    Py_DECREF(eseq);
    return 1;
}

/* apply(bit, block_size, events, start, lower_parent) -> (next, applied, other_block_size)
 *
 * Applies events[start:] in order up to the first one it leaves to the caller, whose position is
 * ``next`` (len(events) when none): a BlockStored or BlockRemoved on a lower tier, an
 * AllBlocksCleared, an event of another type, or a BlockStored whose parent is neither in the map
 * nor found by ``lower_parent`` (a callable of the engine hash returning a router hash or None;
 * None: the target has no lower tier). ``applied``: the GPU block events applied (blocks stored
 * plus engine hashes removed that resolved); the target's ``counters`` are added to.
 * ``other_block_size``: the first block size an event reported that is not ``block_size`` (0:
 * none; the blocks are hashed with ``block_size``). */
static PyObject *
GpuView_apply(GpuView *v, PyObject *args)
{
    PyObject *bobj, *events, *lower_parent;
    Py_ssize_t bs, start;
    int bit;
    if (!PyArg_ParseTuple(args, "OnOnO:apply", &bobj, &bs, &events, &start, &lower_parent))
        return NULL;
    if (parse_bit(v, bobj, &bit) < 0)
        return NULL;
    if (bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be > 0");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(events, "events must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    ApplyCounts c;
    memset(&c, 0, sizeof(c));
    Scratch scratch;
    scratch.heap = NULL;
    scratch.heap_len = 0;
    Py_ssize_t i = start < 0 ? 0 : start;
    for (; i < n; i++) {
        PyObject *ev = items[i];
        PyTypeObject *tp = Py_TYPE(ev);
        if (tp != (PyTypeObject *)v->removed_type && tp != (PyTypeObject *)v->stored_type)
            break; /* AllBlocksCleared, or another type: the caller's */
        PyObject *medium = PyObject_GetAttr(ev, S_medium);
        if (medium == NULL)
            goto fail;
        int gpu = is_gpu_medium(medium);
        Py_DECREF(medium);
        if (!gpu) {
            /* a BlockStored's kind filter comes before its tier: the caller applies both */
            break;
        }
        if (tp == (PyTypeObject *)v->removed_type) {
            if (apply_removed(v, bit, ev, &c) < 0)
                goto fail;
        }
        else {
            if (apply_stored(v, bit, bs, ev, lower_parent, &c, &scratch) < 0)
                goto fail;
        }
    }
    PyMem_Free(scratch.heap);
    Py_DECREF(seq);
    add_counts(&v->targets[bit], &c);
    return Py_BuildValue("(nnn)", i, c.stored_blocks + c.removed_blocks, c.other_block_size);
fail:
    add_counts(&v->targets[bit], &c); /* what was applied before the error counts */
    PyMem_Free(scratch.heap);
    Py_DECREF(seq);
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* apply_payload: a map-form msgpack batch applied without building its Python objects          */

/* A msgpack reader over one payload. Every read checks the bounds; a value of another type than
 * the one asked for is a failure (the caller then leaves the payload to the Python decoders). */
typedef struct {
    const unsigned char *p, *end;
} Cur;

static int
mp_need(Cur *c, size_t n)
{
    return (size_t)(c->end - c->p) >= n ? 0 : -1;
}

static uint64_t
mp_be(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

/* An array's or a map's length (``fix``: its fixed-size type's high nibble, 0x90 or 0x80; ``w16``:
 * its 16-bit type byte, the 32-bit one following it). */
static int
mp_container(Cur *c, unsigned char fix, unsigned char w16, uint32_t *n)
{
    if (mp_need(c, 1) < 0)
        return -1;
    unsigned char b = *c->p;
    if ((b & 0xf0) == fix) {
        *n = b & 0x0f;
        c->p++;
        return 0;
    }
    if (b == w16 || b == w16 + 1) {
        int w = b == w16 ? 2 : 4;
        if (mp_need(c, 1 + w) < 0)
            return -1;
        *n = (uint32_t)mp_be(c->p + 1, w);
        c->p += 1 + w;
        return 0;
    }
    return -1;
}

static int
mp_array(Cur *c, uint32_t *n)
{
    return mp_container(c, 0x90, 0xdc, n);
}

static int
mp_map(Cur *c, uint32_t *n)
{
    return mp_container(c, 0x80, 0xde, n);
}

static int
mp_str(Cur *c, const char **s, uint32_t *len)
{
    if (mp_need(c, 1) < 0)
        return -1;
    unsigned char b = *c->p;
    int w;
    if ((b & 0xe0) == 0xa0) {
        *len = b & 0x1f;
        w = 0;
    }
    else if (b == 0xd9 || b == 0xda || b == 0xdb) {
        w = b == 0xd9 ? 1 : b == 0xda ? 2 : 4;
        if (mp_need(c, 1 + w) < 0)
            return -1;
        *len = (uint32_t)mp_be(c->p + 1, w);
    }
    else {
        return -1;
    }
    if (mp_need(c, 1 + w + (size_t)*len) < 0)
        return -1;
    *s = (const char *)c->p + 1 + w;
    c->p += 1 + w + *len;
    return 0;
}

static int
mp_nil(Cur *c)
{
    if (mp_need(c, 1) == 0 && *c->p == 0xc0) {
        c->p++;
        return 1;
    }
    return 0;
}

/* An int: *u is its value as u64 (a negative one as its two's complement), *neg whether it is
 * negative. Floats, bools and the rest are no ints. */
static int
mp_int(Cur *c, uint64_t *u, int *neg)
{
    if (mp_need(c, 1) < 0)
        return -1;
    unsigned char b = *c->p;
    *neg = 0;
    if (b <= 0x7f) {
        *u = b;
        c->p++;
        return 0;
    }
    if (b >= 0xe0) {
        *u = (uint64_t)(int64_t)(int8_t)b;
        *neg = 1;
        c->p++;
        return 0;
    }
    int w;
    int sign;
    switch (b) {
    case 0xcc: w = 1; sign = 0; break;
    case 0xcd: w = 2; sign = 0; break;
    case 0xce: w = 4; sign = 0; break;
    case 0xcf: w = 8; sign = 0; break;
    case 0xd0: w = 1; sign = 1; break;
    case 0xd1: w = 2; sign = 1; break;
    case 0xd2: w = 4; sign = 1; break;
    case 0xd3: w = 8; sign = 1; break;
    default: return -1;
    }
    if (mp_need(c, 1 + w) < 0)
        return -1;
    uint64_t v = mp_be(c->p + 1, w);
    if (sign && w < 8 && (v >> (8 * w - 1)) & 1)
        v |= ~0ULL << (8 * w); /* sign-extend */
    *u = v;
    *neg = sign && (int64_t)v < 0;
    c->p += 1 + w;
    return 0;
}

/* A bin value: its bytes. */
static int
mp_bin(Cur *c, const unsigned char **data, uint32_t *len)
{
    if (mp_need(c, 1) < 0)
        return -1;
    unsigned char b = *c->p;
    int w = b == 0xc4 ? 1 : b == 0xc5 ? 2 : b == 0xc6 ? 4 : 0;
    if (!w || mp_need(c, 1 + w) < 0)
        return -1;
    *len = (uint32_t)mp_be(c->p + 1, w);
    if (mp_need(c, 1 + w + (size_t)*len) < 0)
        return -1;
    *data = c->p + 1 + w;
    c->p += 1 + w + *len;
    return 0;
}

/* A float (or an int) as a double: the batch's timestamp. */
static int
mp_number(Cur *c, double *out)
{
    if (mp_need(c, 1) < 0)
        return -1;
    unsigned char b = *c->p;
    if (b == 0xcb || b == 0xca) {
        int w = b == 0xcb ? 8 : 4;
        if (mp_need(c, 1 + w) < 0)
            return -1;
        uint64_t v = mp_be(c->p + 1, w);
        if (w == 8) {
            memcpy(out, &v, 8);
        }
        else {
            uint32_t v32 = (uint32_t)v;
            float f;
            memcpy(&f, &v32, 4);
            *out = f;
        }
        c->p += 1 + w;
        return 0;
    }
    uint64_t u;
    int neg;
    if (mp_int(c, &u, &neg) < 0)
        return -1;
    *out = neg ? (double)(int64_t)u : (double)u;
    return 0;
}

/* Skip any one value (nesting bounded). */
static int
mp_skip(Cur *c, int depth)
{
    if (depth > 32 || mp_need(c, 1) < 0)
        return -1;
    unsigned char b = *c->p;
    uint32_t n;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
        c->p++;
        return 0;
    }
    if ((b & 0xf0) == 0x90 || b == 0xdc || b == 0xdd) {
        if (mp_array(c, &n) < 0)
            return -1;
        for (uint32_t i = 0; i < n; i++) {
            if (mp_skip(c, depth + 1) < 0)
                return -1;
        }
        return 0;
    }
    if ((b & 0xf0) == 0x80 || b == 0xde || b == 0xdf) {
        if (mp_map(c, &n) < 0)
            return -1;
        for (uint32_t i = 0; i < 2 * n; i++) {
            if (mp_skip(c, depth + 1) < 0)
                return -1;
        }
        return 0;
    }
    const char *s;
    const unsigned char *d;
    if ((b & 0xe0) == 0xa0 || b == 0xd9 || b == 0xda || b == 0xdb)
        return mp_str(c, &s, &n);
    if (b == 0xc4 || b == 0xc5 || b == 0xc6)
        return mp_bin(c, &d, &n);
    size_t fixed = 0;
    switch (b) {
    case 0xcc: case 0xd0: fixed = 2; break;
    case 0xcd: case 0xd1: fixed = 3; break;
    case 0xca: case 0xce: case 0xd2: fixed = 5; break;
    case 0xcb: case 0xcf: case 0xd3: fixed = 9; break;
    case 0xd4: fixed = 3; break;  /* fixext 1 */
    case 0xd5: fixed = 4; break;
    case 0xd6: fixed = 6; break;
    case 0xd7: fixed = 10; break;
    case 0xd8: fixed = 18; break;
    }
    if (fixed) {
        if (mp_need(c, fixed) < 0)
            return -1;
        c->p += fixed;
        return 0;
    }
    if (b == 0xc7 || b == 0xc8 || b == 0xc9) { /* ext 8/16/32 */
        int w = b == 0xc7 ? 1 : b == 0xc8 ? 2 : 4;
        if (mp_need(c, 1 + w) < 0)
            return -1;
        size_t len = (size_t)mp_be(c->p + 1, w);
        if (mp_need(c, 1 + w + 1 + len) < 0)
            return -1;
        c->p += 1 + w + 1 + len;
        return 0;
    }
    return -1; /* 0xc1: never used */
}

/* An engine hash (int or bin) as its u64 key: the same keys engine_key() makes of the Python
 * values the decoders would build (an int's two's complement, a bin's seeded XXH3). */
static int
mp_engine_key(Cur *c, uint64_t *key)
{
    uint64_t u;
    int neg;
    if (mp_need(c, 1) < 0)
        return -1;
    unsigned char b = *c->p;
    if (b == 0xc4 || b == 0xc5 || b == 0xc6) {
        const unsigned char *d;
        uint32_t len;
        if (mp_bin(c, &d, &len) < 0)
            return -1;
        *key = XXH3_64_seed(d, len, FOLD_SEED_BYTES);
        return 0;
    }
    if (mp_int(c, &u, &neg) < 0)
        return -1;
    *key = u;
    return 0;
}

enum { EV_STORED = 1, EV_REMOVED = 2 };

/* One event of the payload, as checked by the first pass: where its arrays start. */
typedef struct {
    int kind;
    int skipped;               /* BlockStored of a kind that is not full attention */
    Cur hashes;                /* at the first engine hash */
    uint32_t nhashes;
    int has_parent;
    Cur parent;
    Cur tokens;                /* at the first token id */
    uint32_t ntokens;
    int64_t block_size;
} RawEvent;

static int
key_is(const char *k, uint32_t n, const char *want)
{
    size_t w = strlen(want);
    return n == w && memcmp(k, want, w) == 0;
}

/* The GPU tier: a nil medium, or "GPU" in any case (as is_gpu_medium). */
static int
mp_gpu_medium(Cur *c, int *gpu)
{
    if (mp_nil(c)) {
        *gpu = 1;
        return 0;
    }
    const char *s;
    uint32_t n;
    if (mp_str(c, &s, &n) < 0)
        return -1;
    *gpu = n == 3 && (s[0] | 0x20) == 'g' && (s[1] | 0x20) == 'p' && (s[2] | 0x20) == 'u';
    return 0;
}

/* First pass over one map-form event. 0: it can be applied here; -1: leave the payload to Python
 * (another form, a type the decoders would refuse or convert, a lower tier, a clear...). */
static int
parse_event(GpuView *v, Cur *c, RawEvent *ev)
{
    uint32_t nkeys;
    if (mp_map(c, &nkeys) < 0)
        return -1;
    memset(ev, 0, sizeof(*ev));
    int have_hashes = 0, have_tokens = 0, have_bs = 0, have_parent_key = 0;
    for (uint32_t k = 0; k < nkeys; k++) {
        const char *key;
        uint32_t klen;
        if (mp_str(c, &key, &klen) < 0)
            return -1;
        if (key_is(key, klen, "type")) {
            const char *t;
            uint32_t tlen;
            if (mp_str(c, &t, &tlen) < 0 || ev->kind)
                return -1;
            if (key_is(t, tlen, "BlockStored"))
                ev->kind = EV_STORED;
            else if (key_is(t, tlen, "BlockRemoved"))
                ev->kind = EV_REMOVED;
            else
                return -1; /* a clear, or a type the decoders skip */
        }
        else if (key_is(key, klen, "block_hashes")) {
            if (have_hashes || mp_array(c, &ev->nhashes) < 0)
                return -1;
            have_hashes = 1;
            ev->hashes = *c;
            for (uint32_t i = 0; i < ev->nhashes; i++) {
                uint64_t h;
                if (mp_engine_key(c, &h) < 0)
                    return -1;
            }
        }
        else if (key_is(key, klen, "parent_block_hash")) {
            if (have_parent_key)
                return -1;
            have_parent_key = 1;
            if (!mp_nil(c)) {
                uint64_t h;
                ev->has_parent = 1;
                ev->parent = *c;
                if (mp_engine_key(c, &h) < 0)
                    return -1;
            }
        }
        else if (key_is(key, klen, "token_ids")) {
            if (have_tokens || mp_array(c, &ev->ntokens) < 0)
                return -1;
            have_tokens = 1;
            ev->tokens = *c;
            for (uint32_t i = 0; i < ev->ntokens; i++) {
                uint64_t t;
                int neg;
                if (mp_int(c, &t, &neg) < 0 || neg || t > 0xFFFFFFFFULL)
                    return -1; /* a bigram pair or an id the Python path drops: its call */
            }
        }
        else if (key_is(key, klen, "block_size")) {
            uint64_t u;
            int neg;
            if (have_bs || mp_int(c, &u, &neg) < 0)
                return -1;
            have_bs = 1;
            ev->block_size = (int64_t)u;
        }
        else if (key_is(key, klen, "medium")) {
            int gpu;
            if (mp_gpu_medium(c, &gpu) < 0 || !gpu)
                return -1;
        }
        else if (key_is(key, klen, "kv_cache_spec_kind")) {
            /* each value decides, so a repeated key's last one does, as msgspec's decoders keep the
             * last (a nil after "sliding_window" once left the event skipped here, stored there) */
            ev->skipped = 0;
            if (!mp_nil(c)) {
                const char *kind;
                uint32_t kn;
                if (mp_str(c, &kind, &kn) < 0)
                    return -1;
                PyObject *s = PyUnicode_DecodeUTF8(kind, kn, NULL);
                if (s == NULL) {
                    PyErr_Clear();
                    return -1;
                }
                int full = PySet_Contains(v->full_kinds, s);
                Py_DECREF(s);
                if (full < 0) {
                    PyErr_Clear();
                    return -1;
                }
                ev->skipped = !full;
            }
        }
        else if (mp_skip(c, 0) < 0) {
            return -1;
        }
    }
    if (ev->kind == EV_STORED)
        return have_hashes && have_tokens && have_bs && have_parent_key ? 0 : -1;
    if (ev->kind == EV_REMOVED) {
        ev->skipped = 0; /* a kind on a removal is a field BlockRemoved does not have: ignored */
        return have_hashes ? 0 : -1;
    }
    return -1;
}

/* apply_payload(bit, block_size, payload) -> (applied, ts, other_block_size) or None
 *
 * A map-form batch ``[ts, [event maps...], dp_rank?]`` of GPU BlockStored/BlockRemoved events
 * (what vLLM, SGLang >= 0.5.22 and the simulator send in steady state), applied as ``apply`` does
 * with the decoded events, without building them: a first pass checks the whole payload, a second
 * applies it. None, with nothing changed, for anything else: the caller decodes it and calls
 * ``apply``. For a target with lower tiers the caller never calls this (parents may live there). */
static PyObject *
GpuView_apply_payload(GpuView *v, PyObject *args)
{
    PyObject *bobj;
    Py_ssize_t bs;
    Py_buffer payload;
    int bit;
    if (!PyArg_ParseTuple(args, "Ony*:apply_payload", &bobj, &bs, &payload))
        return NULL;
    PyObject *result = NULL;
    RawEvent stack_events[16];
    RawEvent *events = stack_events;
    if (parse_bit(v, bobj, &bit) < 0)
        goto done;
    if (bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be > 0");
        goto done;
    }
    Cur c = {(const unsigned char *)payload.buf, (const unsigned char *)payload.buf + payload.len};
    uint32_t nfields, nevents;
    double ts;
    if (mp_array(&c, &nfields) < 0 || nfields < 2 || nfields > 3 || mp_number(&c, &ts) < 0 ||
        mp_array(&c, &nevents) < 0) {
        result = Py_None;
        goto done;
    }
    if (nevents > 16) {
        if ((size_t)nevents > (size_t)(c.end - c.p)) { /* every event takes a byte at least */
            result = Py_None;
            goto done;
        }
        events = PyMem_Malloc((size_t)nevents * sizeof(RawEvent));
        if (events == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    for (uint32_t i = 0; i < nevents; i++) {
        if (parse_event(v, &c, &events[i]) < 0) {
            result = Py_None;
            goto done;
        }
    }
    if (nfields == 3) {
        uint64_t u;
        int neg;
        if (!mp_nil(&c) && mp_int(&c, &u, &neg) < 0) {
            result = Py_None;
            goto done;
        }
    }
    if (c.p != c.end) { /* trailing bytes: not one msgpack value */
        result = Py_None;
        goto done;
    }

    /* second pass: apply, as apply_removed / apply_stored do */
    ApplyCounts n;
    memset(&n, 0, sizeof(n));
    Scratch scratch;
    scratch.heap = NULL;
    scratch.heap_len = 0;
    uint32_t *ids = NULL;
    size_t ids_cap = 0;
    for (uint32_t i = 0; i < nevents; i++) {
        RawEvent *ev = &events[i];
        Target *t = &v->targets[bit];
        if (ev->kind == EV_REMOVED) {
            n.removed_events++;
            Cur hc = ev->hashes;
            for (uint32_t j = 0; j < ev->nhashes; j++) {
                uint64_t key, h;
                mp_engine_key(&hc, &key);
                if (!map_pop(&t->emap, key, &h))
                    continue;
                n.removed_blocks++;
                if (h_clear_bit(&v->holders, h, bit))
                    t->count--;
            }
            continue;
        }
        if (ev->skipped) {
            n.skipped_events++;
            continue;
        }
        uint64_t h = 0; /* ROUTER_SEED */
        if (ev->has_parent) {
            Cur pc = ev->parent;
            uint64_t pkey;
            mp_engine_key(&pc, &pkey);
            int64_t at = map_find(&t->emap, pkey);
            if (at < 0) {
                n.dropped_events++;
                continue;
            }
            h = t->emap.vals[at];
        }
        if (ev->block_size != bs && n.other_block_size == 0)
            n.other_block_size = ev->block_size ? (Py_ssize_t)ev->block_size : -1;
        Py_ssize_t nblocks = (Py_ssize_t)ev->ntokens / bs;
        n.stored_events++;
        n.stored_blocks += nblocks;
        int aligned = (uint32_t)nblocks == ev->nhashes;
        if (!aligned) {
            n.misaligned_events++;
            if (nblocks)
                t->unmapped = 1;
        }
        if ((size_t)nblocks * (size_t)bs > ids_cap) {
            size_t cap = (size_t)nblocks * (size_t)bs;
            uint32_t *grown = PyMem_Realloc(ids, cap * sizeof(uint32_t));
            if (grown == NULL) {
                PyMem_Free(ids);
                PyMem_Free(scratch.heap);
                PyErr_NoMemory();
                goto done;
            }
            ids = grown;
            ids_cap = cap;
        }
        Cur tc = ev->tokens;
        for (Py_ssize_t j = 0; j < nblocks * bs; j++) {
            uint64_t tok;
            int neg;
            mp_int(&tc, &tok, &neg);
            ids[j] = (uint32_t)tok;
        }
        unsigned char *buf = scratch_get(&scratch, 8 + bs * 4);
        if (buf == NULL) {
            PyMem_Free(ids);
            goto done;
        }
        size_t span = (size_t)bs * 4;
        Cur hc = ev->hashes;
        for (Py_ssize_t b = 0; b < nblocks; b++) {
            memcpy(buf, &h, 8);
            memcpy(buf + 8, ids + b * bs, span);
            h = XXH3_64(buf, 8 + span);
            if (aligned) {
                uint64_t ekey;
                mp_engine_key(&hc, &ekey);
                if (map_put(&t->emap, ekey, h) < 0) {
                    PyMem_Free(ids);
                    PyMem_Free(scratch.heap);
                    goto done;
                }
            }
            int set = h_set_bit(&v->holders, h, bit);
            if (set < 0) {
                PyMem_Free(ids);
                PyMem_Free(scratch.heap);
                goto done;
            }
            t->count += set;
        }
    }
    PyMem_Free(ids);
    PyMem_Free(scratch.heap);
    add_counts(&v->targets[bit], &n);
    result = Py_BuildValue("(ndn)", n.stored_blocks + n.removed_blocks, ts, n.other_block_size);
done:
    if (result == Py_None)
        Py_INCREF(result);
    if (events != stack_events)
        PyMem_Free(events);
    PyBuffer_Release(&payload);
    return result;
}

static PyMethodDef GpuView_methods[] = {
    {"add", (PyCFunction)GpuView_add, METH_O, "add(bit): a new, empty target"},
    {"remove", (PyCFunction)GpuView_remove, METH_O, "remove(bit): drop its view and free the bit"},
    {"drop", (PyCFunction)GpuView_drop, METH_O, "drop(bit): empty the target's view and map"},
    {"count", (PyCFunction)GpuView_count, METH_O, "count(bit): router hashes in the target's view"},
    {"counts", (PyCFunction)GpuView_counts, METH_O, "counts(bits): count(bit) of each (0: no such target)"},
    {"mapped", (PyCFunction)GpuView_mapped, METH_O, "mapped(bit): engine hashes the target can resolve"},
    {"counters", (PyCFunction)GpuView_counters, METH_O, "counters(bit): the target's event counters"},
    {"holds", (PyCFunction)GpuView_holds, METH_VARARGS, "holds(bit, router_hash) -> bool"},
    {"emap_get", (PyCFunction)GpuView_emap_get, METH_VARARGS, "emap_get(bit, engine_hash) -> router hash or None"},
    {"first_unheld", (PyCFunction)GpuView_first_unheld, METH_VARARGS,
     "first_unheld(hashes, start=0) -> position of the first hash no target holds"},
    {"match_one", (PyCFunction)GpuView_match_one, METH_VARARGS, "match_one(hashes, bit) -> held prefix length"},
    {"match", (PyCFunction)GpuView_match, METH_VARARGS, "match(hashes, bits) -> held prefix length per bit"},
    {"apply", (PyCFunction)GpuView_apply, METH_VARARGS, "apply(bit, block_size, events, start, lower_parent)"},
    {"apply_payload", (PyCFunction)GpuView_apply_payload, METH_VARARGS,
     "apply_payload(bit, block_size, payload) -> counts, or None to decode it in Python"},
    {NULL},
};

static PySequenceMethods GpuView_as_sequence = {
    .sq_length = (lenfunc)GpuView_len,
};

static PyTypeObject GpuViewType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "infera.kv._native.GpuView",
    .tp_doc = "The index's GPU view: router hash -> holder bits, per target engine hash -> router hash.",
    .tp_basicsize = sizeof(GpuView),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)GpuView_init,
    .tp_dealloc = (destructor)GpuView_dealloc,
    .tp_methods = GpuView_methods,
    .tp_as_sequence = &GpuView_as_sequence,
};

/* ------------------------------------------------------------------------------------------ */
/* BlockCounter                                                                                */

/* A multiset of block hashes (u64): how many requests in flight on a target hold each block. */
typedef struct {
    PyObject_HEAD
    Map64 counts;
} BlockCounter;

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
    if (hashes_get(blocks, &hs) < 0)
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
        else if (map_put(m, key, 1) < 0) {
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
    if (hashes_get(blocks, &hs) < 0)
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
            map_delete_at(m, (uint64_t)at);
    }
    hashes_release(&hs);
    Py_RETURN_NONE;
}

/* The first position >= start of ``hs`` whose hash ``m`` does not hold (hs->n: all are held). */
static Py_ssize_t
counter_run(const Map64 *m, const Hashes *hs, Py_ssize_t start)
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
    if (hashes_get(hashes, &hs) < 0)
        return NULL;
    Py_ssize_t i = counter_run(&bc->counts, &hs, start);
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
        if (!m->used[i])
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

static PyTypeObject BlockCounterType = {
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
    uint64_t dummy;
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
    if (hashes_get(blocks, &hs) < 0)
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
        if (slot < 0 || map_put(&lc->index, key, (uint64_t)slot) < 0) {
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
    if (hashes_get(hashes, &hs) < 0)
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

static PyTypeObject LandedClaimsType = {
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
            size = mp_be(p + q + 1, 8);
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
static PyObject *
py_zmtp_split(PyObject *self, PyObject *args)
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
                size = mp_be(p + q + 1, 8);
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

static PyObject *
py_zmtp_headers_read(PyObject *self, PyObject *noargs)
{
    return PyLong_FromUnsignedLongLong(zmtp_headers);
}

/* ------------------------------------------------------------------------------------------ */
/* score_targets: the kv-aware pick's loop over one group of targets                           */

/* A number kept in a dict (a float or an int) as a double; ``dflt`` when the key is missing. */
static int
dict_number(PyObject *d, PyObject *key, double dflt, double *out)
{
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (v == NULL) {
        if (PyErr_Occurred())
            return -1;
        *out = dflt;
        return 0;
    }
    if (PyFloat_CheckExact(v)) {
        *out = PyFloat_AS_DOUBLE(v);
        return 0;
    }
    double x = PyFloat_AsDouble(v);
    if (x == -1.0 && PyErr_Occurred())
        return -1;
    *out = x;
    return 0;
}

/* A table of blocks in flight (``active[key]``): its length, and (active_run) ``hit`` extended over
 * the blocks of ``hashes`` it holds when it holds the first one, as pick() does. Through the C type
 * when it is one, else the Python protocol (the Python twin). */
static int
active_len(PyObject *active, Py_ssize_t *n)
{
    if (Py_TYPE(active) == &BlockCounterType) {
        *n = (Py_ssize_t)((BlockCounter *)active)->counts.n;
        return 0;
    }
    *n = PyObject_Length(active);
    return *n < 0 ? -1 : 0;
}

static int
active_run(PyObject *active, PyObject *hashes, const Hashes *hs, Py_ssize_t hit, Py_ssize_t *out)
{
    if (Py_TYPE(active) == &BlockCounterType) {
        const Map64 *m = &((BlockCounter *)active)->counts;
        uint64_t first;
        *out = hit;
        if (hs->n > 0 && hashes_at(hs, 0, &first) == 0 && map_find(m, first) >= 0)
            *out = counter_run(m, hs, hit);
        return 0;
    }
    PyObject *first = PySequence_GetItem(hashes, 0);
    if (first == NULL)
        return -1;
    int held = PySequence_Contains(active, first);
    Py_DECREF(first);
    if (held < 0)
        return -1;
    *out = hit;
    if (!held)
        return 0;
    PyObject *r = PyObject_CallMethod(active, "run", "On", hashes, hit);
    if (r == NULL)
        return -1;
    *out = PyLong_AsSsize_t(r);
    Py_DECREF(r);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* score_targets(keys, hits, active, recent, decay, unhashed, inflight, per_request, w_overlap,
 *               total, hashes, pending, held, offset) -> (tied, best_cost, best_load)
 *
 * KvAwarePolicy.pick's loop over one block-size group, for the case without lower tiers, images
 * or debug logging (the Python loop there is the reference; tests/unit/test_pick_native.py runs
 * both in lockstep). Per
 * target: load = len(active[key]) + recent[key] x decay + unhashed[key] + per_request x
 * inflight[key]; hit = hits[i] (None: all 0), extended over the blocks in flight there when
 * ``pending`` and the target has the first one in flight; cost = w_overlap x (total - hit) + load.
 * ``tied``: [(index, hit)] of the targets at the least (cost, load), in order; with ``held`` (a
 * callable: held(keys) -> the blocks cached on each key), reduced to the one with the least
 * (blocks cached, (index - offset) mod len(keys)). Costs and loads are computed in the Python
 * loop's order of operations, so ties come out the same. */
static PyObject *
py_score_targets(PyObject *self, PyObject *args)
{
    PyObject *keys, *hits, *active, *recent, *unhashed, *inflight, *hashes, *held;
    double decay, per_request, w_overlap;
    Py_ssize_t total, offset;
    int pending;
    if (!PyArg_ParseTuple(args, "O!OO!O!dO!O!ddnOpOn:score_targets", &PyList_Type, &keys, &hits, &PyDict_Type,
                          &active, &PyDict_Type, &recent, &decay, &PyDict_Type, &unhashed, &PyDict_Type, &inflight,
                          &per_request, &w_overlap, &total, &hashes, &pending, &held, &offset))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (hits != Py_None && (!PyList_Check(hits) || PyList_GET_SIZE(hits) != n)) {
        PyErr_SetString(PyExc_ValueError, "hits must be None or a list as long as keys");
        return NULL;
    }
    Hashes hs;
    memset(&hs, 0, sizeof(hs));
    if (pending && hashes != Py_None && hashes_get(hashes, &hs) < 0)
        return NULL;
    int use_unhashed = PyDict_GET_SIZE(unhashed) > 0;
    double missed_all = w_overlap * (double)total;
    double best_cost = 0.0, best_load = 0.0;
    Py_ssize_t *tied = PyMem_Malloc((size_t)(n ? n : 1) * 2 * sizeof(Py_ssize_t)); /* (index, hit) pairs */
    Py_ssize_t ntied = 0;
    PyObject *out = NULL;
    if (tied == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        Py_ssize_t hit = 0;
        if (hits != Py_None) {
            hit = PyLong_AsSsize_t(PyList_GET_ITEM(hits, i));
            if (hit == -1 && PyErr_Occurred())
                goto done;
        }
        double load, r;
        PyObject *a = PyDict_GetItemWithError(active, key);
        if (a == NULL && PyErr_Occurred())
            goto done;
        Py_ssize_t alen = 0;
        if (a != NULL && active_len(a, &alen) < 0)
            goto done;
        if (alen > 0 && pending && hs.n > 0 && active_run(a, hashes, &hs, hit, &hit) < 0)
            goto done;
        if (dict_number(recent, key, 0.0, &r) < 0)
            goto done;
        load = alen > 0 ? (double)alen + r * decay : r * decay;
        if (use_unhashed) {
            double u;
            if (dict_number(unhashed, key, 0.0, &u) < 0)
                goto done;
            load += u;
        }
        if (per_request != 0.0) {
            double f;
            if (dict_number(inflight, key, 0.0, &f) < 0)
                goto done;
            load += per_request * f;
        }
        double cost = hit ? w_overlap * (double)(total - hit) + load : missed_all + load;
        if (ntied == 0 || cost < best_cost || (cost == best_cost && load < best_load)) {
            best_cost = cost;
            best_load = load;
            tied[0] = i;
            tied[1] = hit;
            ntied = 1;
        }
        else if (cost == best_cost && load == best_load) {
            tied[2 * ntied] = i;
            tied[2 * ntied + 1] = hit;
            ntied++;
        }
    }
    if (ntied > 1 && held != Py_None) {
        Py_ssize_t chosen = 0;
        long long least_held = 0;
        Py_ssize_t least_turn = 0;
        PyObject *counts = PyObject_CallOneArg(held, keys);
        if (counts == NULL)
            goto done;
        if (!PyList_Check(counts) || PyList_GET_SIZE(counts) != n) {
            Py_DECREF(counts);
            PyErr_SetString(PyExc_ValueError, "held(keys) must give a list as long as keys");
            goto done;
        }
        for (Py_ssize_t t = 0; t < ntied; t++) {
            long long blocks = PyLong_AsLongLong(PyList_GET_ITEM(counts, tied[2 * t]));
            if (blocks == -1 && PyErr_Occurred()) {
                Py_DECREF(counts);
                goto done;
            }
            Py_ssize_t turn = ((tied[2 * t] - offset) % n + n) % n;
            if (t == 0 || blocks < least_held || (blocks == least_held && turn < least_turn)) {
                chosen = t;
                least_held = blocks;
                least_turn = turn;
            }
        }
        Py_DECREF(counts);
        tied[0] = tied[2 * chosen];
        tied[1] = tied[2 * chosen + 1];
        ntied = 1;
    }
    PyObject *list = PyList_New(ntied);
    if (list == NULL)
        goto done;
    for (Py_ssize_t t = 0; t < ntied; t++) {
        PyObject *pair = Py_BuildValue("(nn)", tied[2 * t], tied[2 * t + 1]);
        if (pair == NULL) {
            Py_DECREF(list);
            goto done;
        }
        PyList_SET_ITEM(list, t, pair);
    }
    out = Py_BuildValue("(Ndd)", list, best_cost, best_load);
done:
    PyMem_Free(tied);
    if (pending && hashes != Py_None)
        hashes_release(&hs);
    return out;
}

/* ------------------------------------------------------------------------------------------ */
/* module                                                                                      */

static PyMethodDef module_methods[] = {
    {"block_hashes", py_block_hashes, METH_VARARGS,
     "block_hashes(tokens, block_size, parent=0) -> chained XXH3-64 hashes of the full blocks"},
    {"block_hash_bytes", py_block_hash_bytes, METH_VARARGS,
     "block_hash_bytes(tokens, block_size, parent=0) -> the chain as u64 little-endian bytes"},
    {"prefix_keys", py_prefix_keys, METH_VARARGS,
     "prefix_keys(data, stride, tag) -> tag + XXH3-128 digest of data[:k*stride] for each k"},
    {"zmtp_split", py_zmtp_split, METH_VARARGS,
     "zmtp_split(buf, start, max_frame, max_message, max_frames, partial=None) -> (items, ends, error, partial): "
     "whole ZMTP messages (frame lists) and commands"},
    {"zmtp_headers_read", py_zmtp_headers_read, METH_NOARGS,
     "zmtp_headers_read() -> frame headers zmtp_split has read (a work counter for the tests)"},
    {"chat_part_keys", py_chat_part_keys, METH_VARARGS,
     "chat_part_keys(messages, prefix, sep, suffix, generation, tag, whole_tag) -> (whole key, part keys, "
     "part lengths) or None"},
    {"score_targets", py_score_targets, METH_VARARGS,
     "score_targets(keys, hits, active, recent, decay, unhashed, inflight, per_request, w_overlap, total, hashes, "
     "pending, held, offset) -> (tied [(index, hit)], best cost, best load): the kv-aware pick's loop"},
    {"encode_builtin", py_encode_builtin, METH_VARARGS,
     "encode_builtin(text, specials=False) -> the built-in tokenizer's ids of ASCII text, or None"},
    {NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "infera.kv._native", "The kv-aware router's per-block and per-token loops in C.", -1,
    module_methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    if (load_xxhash() < 0)
        return NULL;
    init_char_class();
#define INTERN(var, s)                                                                               \
    if ((var = PyUnicode_InternFromString(s)) == NULL)                                               \
        return NULL;
    INTERN(S_block_hashes, "block_hashes");
    INTERN(S_parent, "parent");
    INTERN(S_token_ids, "token_ids");
    INTERN(S_block_size, "block_size");
    INTERN(S_spec_kind, "spec_kind");
    INTERN(S_medium, "medium");
    INTERN(S_role, "role");
    INTERN(S_content, "content");
#undef INTERN
    if (PyType_Ready(&GpuViewType) < 0 || PyType_Ready(&BlockCounterType) < 0 || PyType_Ready(&LandedClaimsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL)
        return NULL;
    PyTypeObject *types[] = {&GpuViewType, &BlockCounterType, &LandedClaimsType};
    const char *names[] = {"GpuView", "BlockCounter", "LandedClaims"};
    for (int i = 0; i < 3; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
