/* GpuView's storage and bookkeeping: targets added and removed, a target's view dropped, its
 * counts and counters, single lookups, and the type with its method table (the matches are in
 * view_match.c, event application in view_apply.c and view_payload.c). In C because the view is
 * read per block of every prompt routed and written per block of every engine event. */
#include "view.h"

/* ------------------------------------------------------------------------------------------ */
/* GpuView                                                                                     */

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
    return 0;
}

int
infera_view_parse_bit(GpuView *v, PyObject *obj, int *bit)
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
    static char *kwlist[] = {"stored", "removed", "cleared", "full_attention_kinds", "shared_bytes", NULL};
    PyObject *stored, *removed, *cleared, *kinds;
    unsigned long long shared_bytes = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|K:GpuView", kwlist, &stored, &removed, &cleared, &kinds,
                                     &shared_bytes))
        return -1;
    if (!PyType_Check(stored) || !PyType_Check(removed) || !PyType_Check(cleared) || !PyAnySet_Check(kinds)) {
        PyErr_SetString(PyExc_TypeError, "GpuView(stored, removed, cleared: types, full_attention_kinds: set)");
        return -1;
    }
    if (v->holders.slots == NULL) {
        if (shared_bytes) { /* the holder table in a shared arena (GpuViewReader reads it elsewhere) */
            if (infera_arena_create(&v->arena, shared_bytes) < 0)
                return -1;
            if (infera_h_share(&v->holders, &v->arena, TABLE_MIN_CAP) < 0)
                return -1;
        }
        else if (infera_h_alloc(&v->holders, TABLE_MIN_CAP) < 0)
            return -1;
    }
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
    for (Py_ssize_t i = 0; i < v->ntargets; i++) {
        map_free(&v->targets[i].emap);
        map_free(&v->targets[i].ehigh);
        map_free(&v->targets[i].tomb);
    }
    PyMem_Free(v->targets);
    infera_h_free(&v->holders);
    if (v->arena.base != NULL)
        infera_arena_close(&v->arena); /* readers keep their own mappings: the memory goes with the last */
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
    if (b < 0 || b >= HS_MAX_IDS) {
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
    map_free(&t->ehigh);
    map_free(&t->tomb);
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
    v->members -= t->count;
    if (t->count && !t->unmapped) {
        /* every viewed hash was added with a map entry: clear through the map */
        for (uint64_t i = 0; i < t->emap.cap && t->count; i++) {
            uint64_t *slot;
            if (map_used(&t->emap, i) && (slot = infera_view_slot_at(v, t, bit, i)) != NULL &&
                infera_h_remove_at(h, slot, (uint32_t)bit))
                t->count--;
        }
    }
    if (t->count) {
        /* misaligned events (or a remapped engine hash) left hashes no map entry names: scan. An
         * entry emptied here is deleted at once; the backward shift only moves entries not yet
         * seen to the slot at i or later (or ones seen already, which lack the id), so slot i is
         * read again after a removal (each removal takes an id: the scan ends). */
        for (uint64_t i = 0; i < h->cap;) {
            uint64_t *slot = h->slots + 2 * i;
            if (slot[1] != 0 && infera_h_remove_at(h, slot, (uint32_t)bit))
                continue;
            i++;
        }
    }
    t->count = 0;
    map_free(&t->emap);
    map_free(&t->ehigh);
    map_free(&t->tomb);
    t->unmapped = 0;
}

static PyObject *
GpuView_drop(GpuView *v, PyObject *arg)
{
    int bit;
    if (infera_view_parse_bit(v, arg, &bit) < 0)
        return NULL;
    view_drop(v, bit);
    Py_RETURN_NONE;
}

/* remove(bit): drop the view and free the bit */
static PyObject *
GpuView_remove(GpuView *v, PyObject *arg)
{
    int bit;
    if (infera_view_parse_bit(v, arg, &bit) < 0)
        return NULL;
    view_drop(v, bit);
    v->targets[bit].live = 0;
    Py_RETURN_NONE;
}

static PyObject *
GpuView_count(GpuView *v, PyObject *arg)
{
    int bit;
    if (infera_view_parse_bit(v, arg, &bit) < 0)
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
    if (infera_view_parse_bit(v, arg, &bit) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(v->targets[bit].emap.n);
}

/* counters(bit) -> (stored_events, stored_blocks, removed_events, removed_blocks, dropped_events,
 * skipped_events, misaligned_events, evicted_entries) since the target was added */
static PyObject *
GpuView_counters(GpuView *v, PyObject *arg)
{
    int bit;
    if (infera_view_parse_bit(v, arg, &bit) < 0)
        return NULL;
    Py_ssize_t *c = v->targets[bit].counters;
    return Py_BuildValue("(nnnnnnnn)", c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]);
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
    if (!PyArg_ParseTuple(args, "OO:holds", &bobj, &hobj) || infera_view_parse_bit(v, bobj, &bit) < 0)
        return NULL;
    if (router_key(hobj, &key) < 0)
        Py_RETURN_FALSE;
    return PyBool_FromLong(h_has(&v->holders, key, (uint32_t)bit));
}

/* emap_get(bit, engine_hash) -> router hash | None */
static PyObject *
GpuView_emap_get(GpuView *v, PyObject *args)
{
    PyObject *bobj, *eobj;
    int bit;
    uint64_t key;
    if (!PyArg_ParseTuple(args, "OO:emap_get", &bobj, &eobj) || infera_view_parse_bit(v, bobj, &bit) < 0)
        return NULL;
    if (infera_engine_key(eobj, &key) < 0)
        return NULL;
    uint64_t h;
    if (infera_view_resolve(v, &v->targets[bit], bit, key, &h) <= 0)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(h);
}

/* memory_bytes() -> the bytes the view's tables have allocated: the holder table and its sets, the
 * targets' maps and the targets' array (not the object itself, nor the allocator's rounding) */
static PyObject *
GpuView_memory_bytes(GpuView *v, PyObject *unused)
{
    uint64_t n = h_bytes(&v->holders) + (uint64_t)v->ntargets * sizeof(Target);
    for (Py_ssize_t i = 0; i < v->ntargets; i++)
        n += map_bytes(&v->targets[i].emap) + map_bytes(&v->targets[i].ehigh) + map_bytes(&v->targets[i].tomb);
    return PyLong_FromUnsignedLongLong(n);
}

/* ------------------------------------------------------------------------------------------ */
/* The byte bound: past it the coldest blocks go                                               */

typedef struct {
    GpuView *v;
    uint64_t entries;
    uint64_t key; /* the router hash being evicted */
} EvictCtx;

static void
evict_member(void *ctx, uint32_t id)
{
    EvictCtx *e = ctx;
    GpuView *v = e->v;
    if ((Py_ssize_t)id < v->ntargets) {
        Target *t = &v->targets[id];
        t->count--;
        t->counters[C_EVICTED]++;
        /* its map entries for the key now name nothing held: remember their low bits, so that a key
         * joining later with the same ones does not inherit them (view_emap.c). Best effort: without
         * memory for it, such an entry may resolve to that key until the next sweep. */
        if (t->emap.n && infera_map_put(&t->tomb, (uint32_t)e->key, (uint32_t)(e->key >> 32)) < 0)
            PyErr_Clear();
    }
    v->members--;
    e->entries++;
}

/* Evict whole age buckets, oldest first, until the model's bytes are at most 95% of the bound (so a
 * round frees a twentieth at least, and its two passes over the table are amortised over as many
 * evictions). Ages are buckets of epochs (u64table.h), the same buckets as the Python twin's, and a
 * bucket goes whole: the twin evicts exactly the same blocks. */
void
infera_view_trim(GpuView *v)
{
    Bound *b = &v->bound;
    uint64_t held = view_bound_bytes(v);
    if (b->max_bytes == 0 || held <= b->max_bytes)
        return;
    uint64_t goal = b->max_bytes - b->max_bytes / 20;
    uint64_t need = held - goal;
    Holders *h = &v->holders;
    uint64_t bytes[HS_AGE_OLD + 1];
    memset(bytes, 0, sizeof(bytes));
    for (uint64_t i = 0; i < h->cap; i++) {
        uint64_t set = h->slots[2 * i + 1];
        if (set == 0)
            continue;
        uint64_t m = hs_count(h->base, set);
        bytes[h_age_of(h, i)] += b->block + b->holder * (m - 1) + b->entry * m;
    }
    uint32_t oldest_kept = 0; /* evict every age > oldest_kept... */
    uint64_t freed = 0;
    int all = 1;
    for (int d = HS_AGE_OLD; d >= 0; d--) {
        freed += bytes[d];
        if (freed >= need) {
            oldest_kept = (uint32_t)d; /* ...and this bucket too */
            all = 0;
            break;
        }
    }
    EvictCtx ctx = {v, 0, 0};
    uint64_t blocks = 0;
    for (uint64_t i = 0; i < h->cap;) {
        uint64_t *slot = h->slots + 2 * i;
        if (slot[1] != 0 && (all || h_age_of(h, i) >= oldest_kept)) {
            ctx.key = slot[0];
            infera_h_evict_at(h, slot, evict_member, &ctx); /* a later key may shift into i: read it again */
            blocks++;
            continue;
        }
        i++;
    }
    b->evicted_entries += ctx.entries;
    b->evicted_blocks += blocks;
    b->rounds++;
    for (Py_ssize_t t = 0; t < v->ntargets; t++) {
        if (v->targets[t].live)
            infera_view_sweep_map(v, (int)t);
    }
}

/* set_bound(max_bytes, block, holder, entry): the bound and the model's costs (0: unbounded) */
static PyObject *
GpuView_set_bound(GpuView *v, PyObject *args)
{
    unsigned long long max_bytes, block, holder, entry;
    if (!PyArg_ParseTuple(args, "KKKK:set_bound", &max_bytes, &block, &holder, &entry))
        return NULL;
    v->bound.max_bytes = max_bytes;
    v->bound.block = block;
    v->bound.holder = holder;
    v->bound.entry = entry;
    v->holders.aging = max_bytes != 0;
    infera_view_trim(v);
    Py_RETURN_NONE;
}

/* bound() -> (bytes held by the model, max_bytes, evicted entries, evicted blocks, eviction rounds) */
static PyObject *
GpuView_bound(GpuView *v, PyObject *unused)
{
    return Py_BuildValue("(KKKKK)", (unsigned long long)view_bound_bytes(v), (unsigned long long)v->bound.max_bytes,
                         (unsigned long long)v->bound.evicted_entries, (unsigned long long)v->bound.evicted_blocks,
                         (unsigned long long)v->bound.rounds);
}

/* tick(): once per batch applied through apply() (apply_payload and the matches tick themselves) */
static PyObject *
GpuView_tick(GpuView *v, PyObject *unused)
{
    infera_h_tick(&v->holders);
    Py_RETURN_NONE;
}

/* trim(): after a batch applied through apply(), evict past the bound (apply_payload trims itself) */
static PyObject *
GpuView_trim(GpuView *v, PyObject *unused)
{
    infera_view_trim(v);
    Py_RETURN_NONE;
}

/* shared() -> (fd, size, bytes taken) of the arena the holder table lives in, or None (private) */
static PyObject *
GpuView_shared(GpuView *v, PyObject *unused)
{
    if (v->arena.base == NULL)
        Py_RETURN_NONE;
    return Py_BuildValue("(iKK)", v->arena.fd, (unsigned long long)v->arena.size,
                         (unsigned long long)arena_header(&v->arena)->used);
}

static PyMethodDef GpuView_methods[] = {
    {"shared", (PyCFunction)GpuView_shared, METH_NOARGS,
     "shared() -> (fd, size, bytes taken) of the shared arena the holder table lives in, or None"},
    {"set_bound", (PyCFunction)GpuView_set_bound, METH_VARARGS,
     "set_bound(max_bytes, block, holder, entry): the byte bound and its model's costs (0: unbounded)"},
    {"bound", (PyCFunction)GpuView_bound, METH_NOARGS,
     "bound() -> (bytes held, max_bytes, evicted entries, evicted blocks, eviction rounds)"},
    {"tick", (PyCFunction)GpuView_tick, METH_NOARGS, "tick(): a batch starts (ages advance)"},
    {"trim", (PyCFunction)GpuView_trim, METH_NOARGS, "trim(): evict the coldest blocks past the bound"},
    {"memory_bytes", (PyCFunction)GpuView_memory_bytes, METH_NOARGS,
     "memory_bytes() -> bytes allocated by the view's tables and holder sets"},
    {"add", (PyCFunction)GpuView_add, METH_O, "add(bit): a new, empty target"},
    {"remove", (PyCFunction)GpuView_remove, METH_O, "remove(bit): drop its view and free the bit"},
    {"drop", (PyCFunction)GpuView_drop, METH_O, "drop(bit): empty the target's view and map"},
    {"count", (PyCFunction)GpuView_count, METH_O, "count(bit): router hashes in the target's view"},
    {"counts", (PyCFunction)GpuView_counts, METH_O, "counts(bits): count(bit) of each (0: no such target)"},
    {"mapped", (PyCFunction)GpuView_mapped, METH_O, "mapped(bit): engine hashes the target can resolve"},
    {"counters", (PyCFunction)GpuView_counters, METH_O, "counters(bit): the target's event counters"},
    {"holds", (PyCFunction)GpuView_holds, METH_VARARGS, "holds(bit, router_hash) -> bool"},
    {"emap_get", (PyCFunction)GpuView_emap_get, METH_VARARGS, "emap_get(bit, engine_hash) -> router hash or None"},
    {"first_unheld", (PyCFunction)infera_GpuView_first_unheld, METH_VARARGS,
     "first_unheld(hashes, start=0) -> position of the first hash no target holds"},
    {"match_one", (PyCFunction)infera_GpuView_match_one, METH_VARARGS, "match_one(hashes, bit) -> held prefix length"},
    {"match", (PyCFunction)infera_GpuView_match, METH_VARARGS, "match(hashes, bits) -> held prefix length per bit"},
    {"apply", (PyCFunction)infera_GpuView_apply, METH_VARARGS, "apply(bit, block_size, events, start, lower_parent)"},
    {"apply_payload", (PyCFunction)infera_GpuView_apply_payload, METH_VARARGS,
     "apply_payload(bit, block_size, payload) -> counts, or None to decode it in Python"},
    {NULL},
};

static PySequenceMethods GpuView_as_sequence = {
    .sq_length = (lenfunc)GpuView_len,
};

PyTypeObject infera_GpuViewType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "infera.kv._native.GpuView",
    .tp_doc = "The index's GPU view: router hash -> holder set (target bits), per target engine hash -> router hash.",
    .tp_basicsize = sizeof(GpuView),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)GpuView_init,
    .tp_dealloc = (destructor)GpuView_dealloc,
    .tp_methods = GpuView_methods,
    .tp_as_sequence = &GpuView_as_sequence,
};
