/* The msgpack reader's value reads (msgpack.h has the small ones): bounds-checked, no allocation,
 * no Python object. In C for view_payload.c, which reads an engine's event batch here instead of
 * decoding it into Python objects. */
#include "msgpack.h"

int
infera_mp_container(Cur *c, unsigned char fix, unsigned char w16, uint32_t *n)
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
        *n = (uint32_t)read_be(c->p + 1, w);
        c->p += 1 + w;
        return 0;
    }
    return -1;
}

int
infera_mp_str(Cur *c, const char **s, uint32_t *len)
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
        *len = (uint32_t)read_be(c->p + 1, w);
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

int
infera_mp_int(Cur *c, uint64_t *u, int *neg)
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
    uint64_t v = read_be(c->p + 1, w);
    if (sign && w < 8 && (v >> (8 * w - 1)) & 1)
        v |= ~0ULL << (8 * w); /* sign-extend */
    *u = v;
    *neg = sign && (int64_t)v < 0;
    c->p += 1 + w;
    return 0;
}

int
infera_mp_bin(Cur *c, const unsigned char **data, uint32_t *len)
{
    if (mp_need(c, 1) < 0)
        return -1;
    unsigned char b = *c->p;
    int w = b == 0xc4 ? 1 : b == 0xc5 ? 2 : b == 0xc6 ? 4 : 0;
    if (!w || mp_need(c, 1 + w) < 0)
        return -1;
    *len = (uint32_t)read_be(c->p + 1, w);
    if (mp_need(c, 1 + w + (size_t)*len) < 0)
        return -1;
    *data = c->p + 1 + w;
    c->p += 1 + w + *len;
    return 0;
}

int
infera_mp_skip(Cur *c, int depth)
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
            if (infera_mp_skip(c, depth + 1) < 0)
                return -1;
        }
        return 0;
    }
    if ((b & 0xf0) == 0x80 || b == 0xde || b == 0xdf) {
        if (mp_map(c, &n) < 0)
            return -1;
        for (uint32_t i = 0; i < 2 * n; i++) {
            if (infera_mp_skip(c, depth + 1) < 0)
                return -1;
        }
        return 0;
    }
    const char *s;
    const unsigned char *d;
    if ((b & 0xe0) == 0xa0 || b == 0xd9 || b == 0xda || b == 0xdb)
        return infera_mp_str(c, &s, &n);
    if (b == 0xc4 || b == 0xc5 || b == 0xc6)
        return infera_mp_bin(c, &d, &n);
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
        size_t len = (size_t)read_be(c->p + 1, w);
        if (mp_need(c, 1 + w + 1 + len) < 0)
            return -1;
        c->p += 1 + w + 1 + len;
        return 0;
    }
    return -1; /* 0xc1: never used */
}
