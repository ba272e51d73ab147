/* GpuView.apply(): decoded KV events (BlockStored / BlockRemoved on the GPU tier) applied to a
 * target's view, the blocks re-hashed in the router's space. In C because engines send an event
 * per allocation, each with a block hash and a block of token ids per block. */
#include "view.h"
#include "xxh.h"

/* ------------------------------------------------------------------------------------------ */
/* GpuView: decoded events applied                                                             */

static PyObject *S_block_hashes, *S_parent, *S_token_ids, *S_block_size, *S_spec_kind, *S_medium;

int
infera_engine_key(PyObject *obj, uint64_t *out)
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
        *out = infera_xxh3_64_seed(PyBytes_AS_STRING(obj), (size_t)PyBytes_GET_SIZE(obj), FOLD_SEED_BYTES);
        return 0;
    }
    Py_hash_t hv = PyObject_Hash(obj);
    if (hv == -1 && PyErr_Occurred())
        return -1;
    uint64_t x = (uint64_t)hv;
    *out = infera_xxh3_64_seed(&x, 8, FOLD_SEED_OTHER);
    return 0;
}

void
infera_view_add_counts(Target *t, const ApplyCounts *c)
{
    t->counters[C_STORED_EVENTS] += c->stored_events;
    t->counters[C_STORED_BLOCKS] += c->stored_blocks;
    t->counters[C_REMOVED_EVENTS] += c->removed_events;
    t->counters[C_REMOVED_BLOCKS] += c->removed_blocks;
    t->counters[C_DROPPED] += c->dropped_events;
    t->counters[C_SKIPPED] += c->skipped_events;
    t->counters[C_MISALIGNED] += c->misaligned_events;
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
        uint64_t key;
        if (infera_engine_key(items[i], &key) < 0) {
            Py_DECREF(seq);
            return -1;
        }
        if (infera_view_unmap(v, t, bit, key) >= 0)  /* (the target's count follows) */
            c->removed_blocks++;
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
        if (infera_engine_key(parent, &pkey) < 0) {
            Py_DECREF(parent);
            return -1;
        }
        if (infera_view_resolve(v, t, bit, pkey, &h) > 0) {
            /* h: the parent's router hash */
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
    if (infera_u32_tokens(tokens, -1, &tk) < 0) { /* all of them: a bad id anywhere drops the event */
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
        h = infera_xxh3_64(buf, 8 + span);
        uint64_t ekey = 0;
        if ((aligned && infera_engine_key(eitems[i], &ekey) < 0) || infera_view_store(v, bit, h, aligned, ekey) < 0) {
            u32_release(&tk);
            Py_DECREF(eseq);
            return -1;
        }
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
PyObject *
infera_GpuView_apply(GpuView *v, PyObject *args)
{
    PyObject *bobj, *events, *lower_parent;
    Py_ssize_t bs, start;
    int bit;
    if (!PyArg_ParseTuple(args, "OnOnO:apply", &bobj, &bs, &events, &start, &lower_parent))
        return NULL;
    if (infera_view_parse_bit(v, bobj, &bit) < 0)
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
    Py_ssize_t count0 = v->targets[bit].count; /* the view's members change by this target's count */
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
    infera_view_add_counts(&v->targets[bit], &c);
    v->members += v->targets[bit].count - count0;
    return Py_BuildValue("(nnn)", i, c.stored_blocks + c.removed_blocks, c.other_block_size);
fail:
    infera_view_add_counts(&v->targets[bit], &c); /* what was applied before the error counts */
    v->members += v->targets[bit].count - count0;
    PyMem_Free(scratch.heap);
    Py_DECREF(seq);
    return NULL;
}

int
infera_view_apply_init(void)
{
#define INTERN(var, s)                                                                               \
    if ((var = PyUnicode_InternFromString(s)) == NULL)                                               \
        return -1;
    INTERN(S_block_hashes, "block_hashes");
    INTERN(S_parent, "parent");
    INTERN(S_token_ids, "token_ids");
    INTERN(S_block_size, "block_size");
    INTERN(S_spec_kind, "spec_kind");
    INTERN(S_medium, "medium");
#undef INTERN
    return 0;
}
