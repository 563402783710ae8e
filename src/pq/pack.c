/* pack.c — PQ code bit-packing: (n, M) indices <-> (n, ceil(M*nbits/8)) bytes (see pack.h). */
#include <string.h>

#include "internal.h"
#include "pq/pack.h"

void kvpq__pack_row(int M, int nbits, const int32_t *idx, uint8_t *out) {
    if (nbits == 8) {
        for (int m = 0; m < M; m++) out[m] = (uint8_t)idx[m];
        return;
    }
    uint64_t acc = 0; /* pending bits, lowest first */
    int nacc = 0;
    size_t o = 0;
    for (int m = 0; m < M; m++) {
        acc |= (uint64_t)(uint32_t)idx[m] << nacc;
        nacc += nbits;
        while (nacc >= 8) {
            out[o++] = (uint8_t)acc;
            acc >>= 8;
            nacc -= 8;
        }
    }
    if (nacc > 0) out[o] = (uint8_t)acc; /* high bits of acc are zero: padding is zero */
}

static kvpq_status check_mn(const char *fn, int M, int nbits) {
    if (M <= 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: M=%d: expected > 0", fn, M);
    if (nbits < 1 || nbits > 16) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: nbits=%d: expected 1..16", fn, nbits);
    return KVPQ_OK;
}

kvpq_status kvpq_codes_pack(int M, int nbits, size_t n, const uint16_t *idx, uint8_t *packed) {
    KVPQ_TRY(check_mn("kvpq_codes_pack", M, nbits));
    if (n && (!idx || !packed)) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codes_pack: NULL array");
    size_t cs = kvpq_codes_size(M, nbits);
    uint32_t lim = 1u << nbits;
    for (size_t i = 0; i < n * (size_t)M; i++)
        if (idx[i] >= lim)
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codes_pack: idx[%zu][%zu] = %u does not fit in nbits=%d",
                             i / (size_t)M, i % (size_t)M, idx[i], nbits);
    for (size_t i = 0; i < n; i++) {
        const uint16_t *r = idx + i * (size_t)M;
        uint8_t *out = packed + i * cs;
        uint64_t acc = 0;
        int nacc = 0;
        size_t o = 0;
        for (int m = 0; m < M; m++) {
            acc |= (uint64_t)r[m] << nacc;
            nacc += nbits;
            while (nacc >= 8) {
                out[o++] = (uint8_t)acc;
                acc >>= 8;
                nacc -= 8;
            }
        }
        if (nacc > 0) out[o] = (uint8_t)acc;
    }
    return KVPQ_OK;
}

kvpq_status kvpq_codes_unpack(int M, int nbits, size_t n, const uint8_t *packed, uint16_t *idx) {
    KVPQ_TRY(check_mn("kvpq_codes_unpack", M, nbits));
    if (n && (!idx || !packed)) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codes_unpack: NULL array");
    size_t cs = kvpq_codes_size(M, nbits);
    for (size_t i = 0; i < n; i++) {
        const uint8_t *in = packed + i * cs;
        uint16_t *r = idx + i * (size_t)M;
        uint64_t acc = 0;
        int nacc = 0;
        size_t p = 0;
        uint32_t mask = (1u << nbits) - 1u;
        for (int m = 0; m < M; m++) {
            while (nacc < nbits) {
                acc |= (uint64_t)in[p++] << nacc;
                nacc += 8;
            }
            r[m] = (uint16_t)(acc & mask);
            acc >>= nbits;
            nacc -= nbits;
        }
    }
    return KVPQ_OK;
}
