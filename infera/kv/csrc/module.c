/* The module infera.kv._native: its function table and its one init (the functions and types
 * are in the files of their concerns, see native.h). */
#include "native.h"

/* ------------------------------------------------------------------------------------------ */
/* module                                                                                      */

static PyMethodDef module_methods[] = {
    {"block_hashes", infera_py_block_hashes, METH_VARARGS,
     "block_hashes(tokens, block_size, parent=0) -> chained XXH3-64 hashes of the full blocks"},
    {"block_hash_bytes", infera_py_block_hash_bytes, METH_VARARGS,
     "block_hash_bytes(tokens, block_size, parent=0) -> the chain as u64 little-endian bytes"},
    {"prefix_keys", infera_py_prefix_keys, METH_VARARGS,
     "prefix_keys(data, stride, tag) -> tag + XXH3-128 digest of data[:k*stride] for each k"},
    {"zmtp_split", infera_py_zmtp_split, METH_VARARGS,
     "zmtp_split(buf, start, max_frame, max_message, max_frames, partial=None) -> (items, ends, error, partial): "
     "whole ZMTP messages (frame lists) and commands"},
    {"zmtp_headers_read", infera_py_zmtp_headers_read, METH_NOARGS,
     "zmtp_headers_read() -> frame headers zmtp_split has read (a work counter for the tests)"},
    {"chat_part_keys", infera_py_chat_part_keys, METH_VARARGS,
     "chat_part_keys(messages, prefix, sep, suffix, generation, tag, whole_tag) -> (whole key, part keys, "
     "part lengths) or None"},
    {"score_targets", infera_py_score_targets, METH_VARARGS,
     "score_targets(keys, hits, active, recent, decay, unhashed, inflight, per_request, w_overlap, total, hashes, "
     "pending, held, offset) -> (tied [(index, hit)], best cost, best load): the kv-aware pick's loop"},
    {"encode_builtin", infera_py_encode_builtin, METH_VARARGS,
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
    if (infera_load_xxhash() < 0)
        return NULL;
    infera_tokenizer_init();
    if (infera_view_apply_init() < 0 || infera_chat_keys_init() < 0)
        return NULL;
    if (PyType_Ready(&infera_GpuViewType) < 0 || PyType_Ready(&infera_BlockCounterType) < 0 ||
        PyType_Ready(&infera_LandedClaimsType) < 0 || PyType_Ready(&infera_GpuViewReaderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL)
        return NULL;
    PyTypeObject *types[] = {&infera_GpuViewType, &infera_BlockCounterType, &infera_LandedClaimsType,
                             &infera_GpuViewReaderType};
    const char *names[] = {"GpuView", "BlockCounter", "LandedClaims", "GpuViewReader"};
    for (int i = 0; i < 4; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
