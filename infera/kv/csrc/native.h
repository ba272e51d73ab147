/* infera.kv._native: the kv-aware router's per-block and per-token loops in C.
 *
 * What runs here is what bench/kv_routing.py --attribute found to cost most per request in the
 * server, all of it work per block or per token that the interpreter did one bytecode at a time.
 * One extension module, one file per concern (infera/kv/csrc/):
 *
 *   - xxh.c:          XXH3 from the xxhash package's own library (dlsym);
 *   - ids.c:          token ids as u32 and router hashes as u64, read from Python objects;
 *   - hashing.c:      block_hashes(), block_hash_bytes(): chained XXH3-64 over full blocks
 *                     (infera/kv/hashing.py); prefix_keys(): the BlockHashCache's XXH3-128 digests
 *                     of a prompt's prefixes;
 *   - chat_keys.c:    chat_part_keys(): a chat's per-message cache keys without rendering it;
 *   - tokenizer.c:    encode_builtin(): the built-in tokenizer's pieces and ids for ASCII text
 *                     (infera/kv/tokenizer.py, the same pieces as its bytes regex);
 *   - u64table.c/.h:  open-addressing tables of plain integers (u64 -> u32, u64 -> holder sets);
 *   - view.c, view_match.c, view_apply.c, view_payload.c (+ msgpack.c):
 *                     GpuView, the index's GPU view (infera/kv/index.py): router hash -> holder
 *                     set (the targets' bits, sized by its members, not the fleet), and per
 *                     target engine hash -> router hash (view_emap.c: its low half, the whole key
 *                     found among the holders' keys that share it; a walk over a prompt's blocks touches a
 *                     few cache lines, not a dict entry and two int objects per block), with
 *                     event application (decoded events, or a msgpack batch as it
 *                     came off the wire) and the prefix matches;
 *   - arena.c/.h, view_reader.c:
 *                     the shared arena a GpuView(shared_bytes=N) keeps its holder table in, and
 *                     GpuViewReader, another process's lock-free matches against it (issue 30
 *                     item 4: one index per host);
 *   - counter.c:      BlockCounter, a multiset of block hashes (the policy's blocks in flight per
 *                     target);
 *   - claims.c:       LandedClaims, blocks a target computed, not yet confirmed by its events;
 *   - zmtp.c:         zmtp_split(), the ZMTP frame scanner (infera/transport/zmtp.py);
 *   - pick.c:         score_targets(), the kv-aware pick's loop over one group of targets;
 *   - module.c:       the module's function table and its one init, PyInit__native.
 *
 * XXH3 comes from the xxhash package's own compiled library: its extension module exports the
 * XXH3_* symbols, found here with dlsym, so every hash is the one infera's Python code computes
 * with the same package (checked at import). When they cannot be found the import fails and the
 * Python implementations run instead (infera/kv/native.py).
 *
 * Every function holds the GIL throughout: the tables are read from tokenizer threads too (the
 * horizon's checks), and no call can interleave with another.
 *
 * Names: what one file defines and others use is prefixed infera_ and declared INFERA_INTERNAL in
 * a header (hidden: the .so exports PyInit__native only, nothing that could clash with another
 * library); everything else is static to its file, or static inline in a header where the hot
 * loops need it inlined.
 */
#ifndef INFERA_NATIVE_H
#define INFERA_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && (__BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__)
#error "infera.kv._native assumes a little-endian machine (token ids and hashes are hashed as LE bytes)"
#endif

#if defined(__GNUC__)
#define INFERA_INTERNAL __attribute__((visibility("hidden")))
#else
#define INFERA_INTERNAL
#endif

/* A big-endian unsigned integer of ``n`` bytes (msgpack's and ZMTP's lengths). */
static inline uint64_t
read_be(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

/* The module's functions (module.c's table), each in the file of its concern. */
INFERA_INTERNAL PyObject *infera_py_block_hashes(PyObject *self, PyObject *args);      /* hashing.c */
INFERA_INTERNAL PyObject *infera_py_block_hash_bytes(PyObject *self, PyObject *args);  /* hashing.c */
INFERA_INTERNAL PyObject *infera_py_prefix_keys(PyObject *self, PyObject *args);       /* hashing.c */
INFERA_INTERNAL PyObject *infera_py_chat_part_keys(PyObject *self, PyObject *args);    /* chat_keys.c */
INFERA_INTERNAL PyObject *infera_py_encode_builtin(PyObject *self, PyObject *args);    /* tokenizer.c */
INFERA_INTERNAL PyObject *infera_py_zmtp_split(PyObject *self, PyObject *args);        /* zmtp.c */
INFERA_INTERNAL PyObject *infera_py_zmtp_headers_read(PyObject *self, PyObject *noargs); /* zmtp.c */
INFERA_INTERNAL PyObject *infera_py_score_targets(PyObject *self, PyObject *args);     /* pick.c */

/* The module's types. */
INFERA_INTERNAL extern PyTypeObject infera_GpuViewType;      /* view.c */
INFERA_INTERNAL extern PyTypeObject infera_GpuViewReaderType; /* view_reader.c */
INFERA_INTERNAL extern PyTypeObject infera_BlockCounterType; /* counter.c */
INFERA_INTERNAL extern PyTypeObject infera_LandedClaimsType; /* claims.c */

/* What the module's init calls first (0, or -1 with an exception set). */
INFERA_INTERNAL int infera_load_xxhash(void);        /* xxh.c */
INFERA_INTERNAL void infera_tokenizer_init(void);    /* tokenizer.c */
INFERA_INTERNAL int infera_view_apply_init(void);    /* view_apply.c */
INFERA_INTERNAL int infera_chat_keys_init(void);     /* chat_keys.c */

#endif
