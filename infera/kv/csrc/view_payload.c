/* GpuView.apply_payload(): a map-form msgpack batch of GPU BlockStored / BlockRemoved events
 * applied straight from the bytes the engine sent, without building its Python objects (checked
 * whole first, then applied). In C because this is the steady state of every engine's event
 * stream: the decoders' objects per event and per block cost more than applying them. */
#include "msgpack.h"
#include "view.h"
#include "xxh.h"

/* ------------------------------------------------------------------------------------------ */
/* apply_payload: a map-form msgpack batch applied without building its Python objects          */

/* An engine hash (int or bin) as its u64 key: the same keys infera_engine_key() makes of the Python
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
        if (infera_mp_bin(c, &d, &len) < 0)
            return -1;
        *key = infera_xxh3_64_seed(d, len, FOLD_SEED_BYTES);
        return 0;
    }
    if (infera_mp_int(c, &u, &neg) < 0)
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
    if (infera_mp_str(c, &s, &n) < 0)
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
        if (infera_mp_str(c, &key, &klen) < 0)
            return -1;
        if (key_is(key, klen, "type")) {
            const char *t;
            uint32_t tlen;
            if (infera_mp_str(c, &t, &tlen) < 0 || ev->kind)
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
                if (infera_mp_int(c, &t, &neg) < 0 || neg || t > 0xFFFFFFFFULL)
                    return -1; /* a bigram pair or an id the Python path drops: its call */
            }
        }
        else if (key_is(key, klen, "block_size")) {
            uint64_t u;
            int neg;
            if (have_bs || infera_mp_int(c, &u, &neg) < 0)
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
                if (infera_mp_str(c, &kind, &kn) < 0)
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
        else if (infera_mp_skip(c, 0) < 0) {
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
PyObject *
infera_GpuView_apply_payload(GpuView *v, PyObject *args)
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
    int applying = 0;
    Py_ssize_t count0 = 0;
    if (infera_view_parse_bit(v, bobj, &bit) < 0)
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
        if (!mp_nil(&c) && infera_mp_int(&c, &u, &neg) < 0) {
            result = Py_None;
            goto done;
        }
    }
    if (c.p != c.end) { /* trailing bytes: not one msgpack value */
        result = Py_None;
        goto done;
    }

    /* second pass: apply, as apply_removed / apply_stored do (a batch: the ages may advance first) */
    infera_h_tick(&v->holders);
    applying = 1;
    count0 = v->targets[bit].count;
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
                uint64_t key;
                mp_engine_key(&hc, &key);
                if (infera_view_unmap(v, t, bit, key) >= 0)  /* (the target's count follows) */
                    n.removed_blocks++;
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
            if (infera_view_resolve(v, t, bit, pkey, &h) <= 0) {
                n.dropped_events++;
                continue;
            }
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
            infera_mp_int(&tc, &tok, &neg);
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
            h = infera_xxh3_64(buf, 8 + span);
            uint64_t ekey = 0;
            if (aligned)
                mp_engine_key(&hc, &ekey);
            if (infera_view_store(v, bit, h, aligned, ekey) < 0) {
                PyMem_Free(ids);
                PyMem_Free(scratch.heap);
                goto done;
            }
        }
    }
    PyMem_Free(ids);
    PyMem_Free(scratch.heap);
    infera_view_add_counts(&v->targets[bit], &n);
    v->members += v->targets[bit].count - count0;
    applying = 0;
    infera_view_trim(v);
    result = Py_BuildValue("(ndn)", n.stored_blocks + n.removed_blocks, ts, n.other_block_size);
done:
    if (applying) /* failed mid-way: what was applied counts */
        v->members += v->targets[bit].count - count0;
    if (result == Py_None)
        Py_INCREF(result);
    if (events != stack_events)
        PyMem_Free(events);
    PyBuffer_Release(&payload);
    return result;
}
