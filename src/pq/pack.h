/* pack.h — bit-packing of PQ codes, shared by pq/ and cache/. Internal.
 * A vector's M codes form a little-endian bit stream: code m occupies bits [m*nbits, (m+1)*nbits),
 * stream bit b is bit (b % 8) of byte b / 8; unused high bits of the last byte are zero. */
#ifndef KVPQ_PACK_H
#define KVPQ_PACK_H

#include <stddef.h>
#include <stdint.h>

/* Pack one vector's M codes (each < 2^nbits, not checked) into ceil(M*nbits/8) bytes. */
void kvpq__pack_row(int M, int nbits, const int32_t *idx, uint8_t *out);

/* Code m of one packed vector of `row_bytes` bytes (nbits 1..16). */
static inline uint32_t kvpq__code_get(const uint8_t *row, size_t row_bytes, int m, int nbits) {
    size_t bit = (size_t)m * (size_t)nbits, byte = bit >> 3;
    uint32_t w = row[byte];
    if (byte + 1 < row_bytes) w |= (uint32_t)row[byte + 1] << 8;
    if (byte + 2 < row_bytes) w |= (uint32_t)row[byte + 2] << 16;
    return (w >> (bit & 7)) & ((1u << nbits) - 1u);
}

#endif
