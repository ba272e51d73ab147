/* A msgpack reader over one payload (msgpack.c; the small reads inline here). Every read checks
 * the bounds; a value of another type than the one asked for is a failure (the caller then leaves
 * the payload to the Python decoders). */
#ifndef INFERA_MSGPACK_H
#define INFERA_MSGPACK_H

#include "native.h"

typedef struct {
    const unsigned char *p, *end;
} Cur;

static inline int
mp_need(Cur *c, size_t n)
{
    return (size_t)(c->end - c->p) >= n ? 0 : -1;
}

/* An array's or a map's length (``fix``: its fixed-size type's high nibble, 0x90 or 0x80; ``w16``:
 * its 16-bit type byte, the 32-bit one following it). */
INFERA_INTERNAL int infera_mp_container(Cur *c, unsigned char fix, unsigned char w16, uint32_t *n);
INFERA_INTERNAL int infera_mp_str(Cur *c, const char **s, uint32_t *len);
/* An int: *u is its value as u64 (a negative one as its two's complement), *neg whether it is
 * negative. Floats, bools and the rest are no ints. */
INFERA_INTERNAL int infera_mp_int(Cur *c, uint64_t *u, int *neg);
/* A bin value: its bytes. */
INFERA_INTERNAL int infera_mp_bin(Cur *c, const unsigned char **data, uint32_t *len);
/* Skip any one value (nesting bounded). */
INFERA_INTERNAL int infera_mp_skip(Cur *c, int depth);

static inline int
mp_array(Cur *c, uint32_t *n)
{
    return infera_mp_container(c, 0x90, 0xdc, n);
}

static inline int
mp_map(Cur *c, uint32_t *n)
{
    return infera_mp_container(c, 0x80, 0xde, n);
}

static inline int
mp_nil(Cur *c)
{
    if (mp_need(c, 1) == 0 && *c->p == 0xc0) {
        c->p++;
        return 1;
    }
    return 0;
}

/* A float (or an int) as a double: the batch's timestamp. */
static inline int
mp_number(Cur *c, double *out)
{
    if (mp_need(c, 1) < 0)
        return -1;
    unsigned char b = *c->p;
    if (b == 0xcb || b == 0xca) {
        int w = b == 0xcb ? 8 : 4;
        if (mp_need(c, 1 + w) < 0)
            return -1;
        uint64_t v = read_be(c->p + 1, w);
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
    if (infera_mp_int(c, &u, &neg) < 0)
        return -1;
    *out = neg ? (double)(int64_t)u : (double)u;
    return 0;
}

#endif
