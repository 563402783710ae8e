/* fp16.h — the one scalar IEEE half / bfloat16 <-> float32 converter of libkvpq. Internal.
 *
 * Half to float is exact. Float to half rounds to nearest, ties to even, as F16C's vcvtps2ph with
 * _MM_FROUND_TO_NEAREST_INT does, so the scalar and SIMD paths give the same bits for every input:
 * magnitudes from 65520 up become infinity, NaN stays NaN (quiet, sign and the top payload bits
 * kept), values below 2^-14 become subnormal halves. bfloat16 is the top half of a float32. */
#ifndef KVPQ_FP16_H
#define KVPQ_FP16_H

#include <stdint.h>
#include <string.h>

static inline float kvpq__f32_from_bits(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline uint32_t kvpq__f32_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static inline float kvpq__h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (e == 0) { /* zero or subnormal: man * 2^-24, exact in float */
        float v = (float)man * 0x1p-24f;
        return sign ? -v : v;
    }
    if (e == 31) return kvpq__f32_from_bits(sign | 0x7f800000u | (man << 13)); /* inf, NaN (payload kept) */
    return kvpq__f32_from_bits(sign | ((e + 112u) << 23) | (man << 13));
}

static inline uint16_t kvpq__f2h(float f) {
    uint32_t x = kvpq__f32_bits(f), ax = x & 0x7fffffffu;
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu)); /* NaN: quiet */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to infinity */
    uint32_t e = ax >> 23, mant = (ax & 0x7fffffu) | 0x800000u;
    if (e < 113) { /* below 2^-14: half subnormal, in units of 2^-24 */
        uint32_t s = 126 - e;
        if (ax == 0 || s > 24) return sign;
        uint32_t r = mant >> s, rem = mant & ((1u << s) - 1), half = 1u << (s - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t h = ((e - 112) << 10) | ((ax & 0x7fffffu) >> 13), rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

static inline float kvpq__bf2f(uint16_t h) { return kvpq__f32_from_bits((uint32_t)h << 16); }

/* A little-endian half at an unaligned byte address (the scale fields of ggml blocks). */
static inline float kvpq__h2f_at(const void *p) {
    const uint8_t *b = (const uint8_t *)p;
    return kvpq__h2f((uint16_t)(b[0] | (b[1] << 8)));
}

#endif
