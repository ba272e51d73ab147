/* GpuView's prefix matches: how far a prompt's blocks are held, by any target or by each of a set
 * of targets, in one walk. In C because every routed request walks its blocks here. */
#include "view.h"

int
infera_first_unheld_args(PyObject *args, Hashes *hs, Py_ssize_t *start)
{
    PyObject *hashes;
    *start = 0;
    if (!PyArg_ParseTuple(args, "O|n:first_unheld", &hashes, start))
        return -1;
    if (*start < 0) {
        PyErr_SetString(PyExc_ValueError, "start must be >= 0");
        return -1;
    }
    return infera_hashes_get(hashes, hs);
}

/* first_unheld(hashes, start=0) -> position of the first of hashes[start:] no target holds */
PyObject *
infera_GpuView_first_unheld(GpuView *v, PyObject *args)
{
    Hashes hs;
    Py_ssize_t start;
    if (infera_first_unheld_args(args, &hs, &start) < 0)
        return NULL;
    Py_ssize_t i = start;
    for (; i < hs.n; i++) {
        uint64_t key;
        if (hs.u64 != NULL && i + H_AHEAD < hs.n)
            h_prefetch(&v->holders, hs.u64[i + H_AHEAD]);
        if (hashes_at(&hs, i, &key) < 0 || h_find(&v->holders, key) == NULL)
            break;
    }
    hashes_release(&hs);
    return PyLong_FromSsize_t(i);
}

/* match_one(hashes, bit) -> length of the prefix of hashes in that target's view */
PyObject *
infera_GpuView_match_one(GpuView *v, PyObject *args)
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
    if (infera_hashes_get(hashes, &hs) < 0)
        return NULL;
    infera_h_tick(&v->holders);
    Py_ssize_t i = 0;
    for (; i < hs.n; i++) {
        uint64_t key, *slot;
        if (hs.u64 != NULL && i + H_AHEAD < hs.n)
            h_prefetch(&v->holders, hs.u64[i + H_AHEAD]);
        if (hashes_at(&hs, i, &key) < 0 || (slot = h_find(&v->holders, key)) == NULL ||
            !hs_has(v->holders.base, slot[1], (uint32_t)b))
            break;
        h_touch(&v->holders, slot); /* a hit: the block is warm */
    }
    hashes_release(&hs);
    return PyLong_FromSsize_t(i);
}

/* The candidates still alive, as a sparse bitmap: the words of the id space that have one, and
 * their masks (ascending words); per word also its candidates at the start (``orig``) and the
 * position of the first of them in the sorted unique bits (``base``), so a candidate's position is
 * base + the candidates below it in orig. ``depth_u``: the lengths, by that position. */
typedef struct {
    uint32_t *word;
    uint64_t *mask;
    uint64_t *orig;
    uint32_t *base;
    uint32_t n;
    Py_ssize_t *depth_u;
} Alive;

/* The candidates of alive word ``k`` in ``dead`` leave at block ``i``. */
static void
alive_die(Alive *a, uint32_t k, uint64_t dead, Py_ssize_t i)
{
    for (; dead; dead &= dead - 1) {
        uint64_t below = (dead & -dead) - 1;
        a->depth_u[a->base[k] + (uint32_t)__builtin_popcountll(a->orig[k] & below)] = i;
    }
}

/* Alive word ``k`` kept as the ``kept``-th with ``held``. */
static inline void
alive_move(Alive *a, uint32_t k, uint32_t kept, uint64_t held)
{
    a->word[kept] = a->word[k];
    a->mask[kept] = held;
    a->orig[kept] = a->orig[k];
    a->base[kept] = a->base[k];
}

/* Keep the alive candidates the set ``v`` (relative to ``base``) holds; the others leave at block
 * ``i``. Work: the alive words, plus the set's ids when it is a list of them (a merge): never the
 * fleet's size. */
static void
alive_keep(Alive *a, uint64_t base, uint64_t v, Py_ssize_t i)
{
    uint32_t kept = 0;
    if ((v & HS_EXT) && (v & HS_BITMAP)) {
        const HBits *b = hs_bits(base, v);
        for (uint32_t k = 0; k < a->n; k++) {
            uint32_t w = a->word[k];
            uint64_t mask = a->mask[k], held = w < b->words ? b->bits[w] & mask : 0;
            if (held != mask)
                alive_die(a, k, mask & ~held, i);
            if (held)
                alive_move(a, k, kept++, held);
        }
        a->n = kept;
        return;
    }
    if (!(v & HS_EXT) && (v & HS_BITMAP)) { /* every id in word 0 */
        uint64_t set = v & HS_SMALL_MASK;
        for (uint32_t k = 0; k < a->n; k++) {
            uint32_t w = a->word[k];
            uint64_t mask = a->mask[k], held = w == 0 ? mask & set : 0;
            if (held != mask)
                alive_die(a, k, mask & ~held, i);
            if (held)
                alive_move(a, k, kept++, held);
        }
        a->n = kept;
        return;
    }
    uint32_t buf[HS_INLINE];
    const uint32_t *ids;
    uint32_t nids;
    if (v & HS_EXT) {
        ids = hs_arr(base, v)->ids;
        nids = hs_arr(base, v)->n;
    }
    else {
        nids = hs_list_ids(v, buf);
        ids = buf;
    }
    uint32_t j = 0;
    for (uint32_t k = 0; k < a->n; k++) {
        uint32_t w = a->word[k];
        uint64_t mask = a->mask[k], set = 0;
        while (j < nids && (ids[j] >> 6) < w)
            j++;
        for (; j < nids && (ids[j] >> 6) == w; j++)
            set |= 1ULL << (ids[j] & 63);
        uint64_t held = mask & set;
        if (held != mask)
            alive_die(a, k, mask & ~held, i);
        if (held)
            alive_move(a, k, kept++, held);
    }
    a->n = kept;
}

/* Sort the n entries (bit << 32 | index) by bit (bits < 2^20: two stable counting passes of 11 and
 * 9 bits, through tmp), in O(n) for the fleets' candidate lists. */
static void
sort_by_bit(uint64_t *v, uint64_t *tmp, Py_ssize_t n)
{
    static const int shift[2] = {32, 43};
    uint32_t count[2048];
    for (int pass = 0; pass < 2; pass++) {
        uint64_t *src = pass ? tmp : v, *dst = pass ? v : tmp;
        memset(count, 0, sizeof(count));
        for (Py_ssize_t k = 0; k < n; k++)
            count[(src[k] >> shift[pass]) & 2047]++;
        uint32_t at = 0;
        for (int d = 0; d < 2048; d++) {
            uint32_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (Py_ssize_t k = 0; k < n; k++)
            dst[count[(src[k] >> shift[pass]) & 2047]++] = src[k];
    }
}

/* The walk of match(hashes, bits) -> for each bit (no such target: 0), the length of the longest
 * prefix of hashes in that target's view. One walk for all: the candidates still alive (a sparse
 * bitmap) are intersected with each block's holders, a candidate's length is fixed when it leaves,
 * and the walk ends when none is left. A block costs the words of the candidates alive at it, plus
 * its holders when they are a list; a request, its blocks times that: neither grows with the
 * fleet. The view is read through ``src`` (a GpuView's own tables, or a shared one's, read by
 * another process: view_reader.c); None when a block could not be read. */
PyObject *
infera_match_walk(const MatchSource *src, PyObject *hashes, PyObject *bits_obj)
{
    PyObject *bseq = PySequence_Fast(bits_obj, "bits must be a sequence");
    if (bseq == NULL)
        return NULL;
    Hashes hs;
    if (infera_hashes_get(hashes, &hs) < 0) {
        Py_DECREF(bseq);
        return NULL;
    }
    Py_ssize_t nc = PySequence_Fast_GET_SIZE(bseq), nh = hs.n;
    PyObject **bitems = PySequence_Fast_ITEMS(bseq);
    /* per candidate: (bit << 32 | index), sorted; per unique bit its depth; the alive words */
    uint64_t stack_order[64], stack_mask[64], stack_orig[64];
    uint32_t stack_base[64], stack_word[64], stack_cu[64];
    Py_ssize_t stack_depth[64];
    int small = nc <= 64;
    uint64_t *order = small ? stack_order : PyMem_Malloc((size_t)nc * sizeof(uint64_t));
    uint64_t *amask = small ? stack_mask : PyMem_Malloc((size_t)nc * sizeof(uint64_t));
    uint64_t *aorig = small ? stack_orig : PyMem_Malloc((size_t)nc * sizeof(uint64_t));
    uint32_t *abase = small ? stack_base : PyMem_Malloc((size_t)nc * sizeof(uint32_t));
    uint32_t *aword = small ? stack_word : PyMem_Malloc((size_t)nc * sizeof(uint32_t));
    uint32_t *cu = small ? stack_cu : PyMem_Malloc((size_t)nc * sizeof(uint32_t)); /* candidate -> unique bit */
    Py_ssize_t *depth_u = small ? stack_depth : PyMem_Malloc((size_t)nc * sizeof(Py_ssize_t));
    PyObject *out = NULL;
    if (order == NULL || amask == NULL || aorig == NULL || abase == NULL || aword == NULL || cu == NULL ||
        depth_u == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t nlive = 0;
    for (Py_ssize_t c = 0; c < nc; c++) {
        long b = PyLong_AsLong(bitems[c]);
        if (b == -1 && PyErr_Occurred())
            goto done;
        cu[c] = UINT32_MAX;
        if (b < 0 || b >= HS_MAX_IDS || !src->bit_ok(src->ctx, (uint32_t)b))
            continue;
        order[nlive++] = ((uint64_t)b << 32) | (uint64_t)c;
    }
    Py_ssize_t sorted = 1;
    while (sorted < nlive && order[sorted - 1] < order[sorted])
        sorted++;
    if (sorted >= nlive) {
        /* in order already (a fleet's keys usually are): nothing to do */
    }
    else if (nlive > 64) {
        uint64_t *tmp = PyMem_Malloc((size_t)nlive * sizeof(uint64_t));
        if (tmp == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        sort_by_bit(order, tmp, nlive);
        PyMem_Free(tmp);
    }
    else {
        for (Py_ssize_t k = 1; k < nlive; k++) { /* a few candidates: in place */
            uint64_t x = order[k];
            Py_ssize_t j = k;
            for (; j > 0 && order[j - 1] > x; j--)
                order[j] = order[j - 1];
            order[j] = x;
        }
    }
    uint32_t m = 0, last = UINT32_MAX;
    Alive al = {aword, amask, aorig, abase, 0, depth_u};
    for (Py_ssize_t k = 0; k < nlive; k++) {
        uint32_t bit = (uint32_t)(order[k] >> 32), c = (uint32_t)order[k];
        if (bit != last) { /* a new unique bit: the m-th */
            last = bit;
            depth_u[m] = nh; /* held all the way, unless it leaves */
            if (al.n == 0 || aword[al.n - 1] != bit >> 6) {
                aword[al.n] = bit >> 6;
                amask[al.n] = 0;
                abase[al.n++] = m;
            }
            amask[al.n - 1] |= 1ULL << (bit & 63);
            m++;
        }
        cu[c] = m - 1;
    }
    memcpy(aorig, amask, (size_t)al.n * sizeof(uint64_t));
    for (Py_ssize_t i = 0; i < nh && al.n; i++) {
        uint64_t key, set = 0;
        int found = 0;
        if (hs.u64 != NULL && i + H_AHEAD < nh && src->prefetch != NULL)
            src->prefetch(src->ctx, hs.u64[i + H_AHEAD]);
        if (hashes_at(&hs, i, &key) == 0)
            found = src->lookup(src->ctx, key, &set); /* its first call: a walk with a candidate and a block */
        if (found < 0) {
            out = Py_NewRef(Py_None); /* unreadable: no answer rather than a wrong one */
            goto done;
        }
        if (!found) {
            for (uint32_t k = 0; k < al.n; k++)
                alive_die(&al, k, amask[k], i);
            break;
        }
        alive_keep(&al, src->base, set, i);
    }
    out = PyList_New(nc);
    if (out == NULL)
        goto done;
    for (Py_ssize_t c = 0; c < nc; c++) {
        PyObject *d = PyLong_FromSsize_t(cu[c] == UINT32_MAX ? 0 : depth_u[cu[c]]);
        if (d == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, c, d);
    }
done:
    if (!small) {
        PyMem_Free(order);
        PyMem_Free(amask);
        PyMem_Free(aorig);
        PyMem_Free(abase);
        PyMem_Free(aword);
        PyMem_Free(cu);
        PyMem_Free(depth_u);
    }
    Py_DECREF(bseq);
    hashes_release(&hs);
    return out;
}

/* GpuView's own tables as a match source: the walk ticks the ages once and touches what it finds. */
typedef struct {
    GpuView *v;
    int ticked;
} OwnWalk;

static int
own_bit_ok(void *ctx, uint32_t b)
{
    const GpuView *v = ((OwnWalk *)ctx)->v;
    return (Py_ssize_t)b < v->ntargets && v->targets[b].live;
}

static void
own_prefetch(void *ctx, uint64_t key)
{
    h_prefetch(&((OwnWalk *)ctx)->v->holders, key);
}

static int
own_lookup(void *ctx, uint64_t key, uint64_t *set)
{
    OwnWalk *w = ctx;
    Holders *h = &w->v->holders;
    if (!w->ticked) { /* (as the twin: a match with a candidate and a block) */
        infera_h_tick(h);
        w->ticked = 1;
    }
    uint64_t *slot = h_find(h, key);
    if (slot == NULL)
        return 0;
    h_touch(h, slot); /* walked to: warm (the twin's match touches the same blocks) */
    *set = slot[1];
    return 1;
}

/* match(hashes, bits) -> for each bit (-1: no such target, 0), the longest prefix of hashes held */
PyObject *
infera_GpuView_match(GpuView *v, PyObject *args)
{
    PyObject *hashes, *bits_obj;
    if (!PyArg_ParseTuple(args, "OO:match", &hashes, &bits_obj))
        return NULL;
    OwnWalk w = {v, 0};
    MatchSource src = {&w, v->holders.base, own_bit_ok, own_lookup, own_prefetch};
    return infera_match_walk(&src, hashes, bits_obj);
}
