/* Growth and deletion of the open-addressing tables of u64 keys (u64table.h has the probes). */
#include "u64table.h"

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
            infera_map_put(m, old.keys[i], old.vals[i]);
    }
    map_free(&old);
    return 0;
}

int
infera_map_put(Map64 *m, uint64_t key, uint64_t val)
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

void
infera_map_delete_at(Map64 *m, uint64_t i)
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

int
infera_h_rebuild(Holders *h, uint64_t cap, int words)
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

void
infera_h_delete(Holders *h, uint64_t *slot)
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
