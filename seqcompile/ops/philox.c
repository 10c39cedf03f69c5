/* Philox4x32 on CPU for the dropout streams (seqcompile/ops/random.py defines them): the flat
 * stream's numbers (10 rounds), and the words of a grid of counters (any number of rounds). Blocks are computed LANES at a time, so
 * the compiler can run the rounds in vector registers. */
#include <stdint.h>

#define LANES 16

/* The rounds, in place on LANES counters, under the key (k0, k1). */
static inline __attribute__((always_inline)) void philox_rounds(uint32_t k0, uint32_t k1,
                                                                int rounds,
                                                                uint32_t c[4][LANES]) {
    for (int round = 0; round < rounds; round++) {
        for (int j = 0; j < LANES; j++) {
            uint64_t a = (uint64_t)0xD2511F53u * c[0][j];
            uint64_t b = (uint64_t)0xCD9E8D57u * c[2][j];
            uint32_t n0 = (uint32_t)(b >> 32) ^ c[1][j] ^ k0;
            uint32_t n2 = (uint32_t)(a >> 32) ^ c[3][j] ^ k1;
            c[1][j] = (uint32_t)b;
            c[3][j] = (uint32_t)a;
            c[0][j] = n0;
            c[2][j] = n2;
        }
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

/* out[o] for o in [0, count): the flat stream's numbers from offset 0. The element at offset o
 * takes word o % 4 of the block on the counter (o / 4 low word, o / 4 high word, stream, 0), its
 * top 24 bits as a float in [0, 1). Built for AVX2 and for the baseline instruction set; the
 * loader picks the one this CPU runs (so below). */
__attribute__((target_clones("avx2", "default")))
void seqfast_philox_uniforms(const int64_t *seed, uint32_t stream, int64_t count, float *out) {
    const uint64_t key = (uint64_t)seed[0];
    const float scale = 1.0f / 16777216.0f;
    uint32_t c[4][LANES];
    for (int64_t start = 0; start < count; start += 4 * LANES) {
        for (int j = 0; j < LANES; j++) {
            uint64_t block = (uint64_t)start / 4 + (uint64_t)j;
            c[0][j] = (uint32_t)block;
            c[1][j] = (uint32_t)(block >> 32);
            c[2][j] = stream;
            c[3][j] = 0;
        }
        philox_rounds((uint32_t)key, (uint32_t)(key >> 32), 10, c);
        int64_t left = count - start;
        if (left >= 4 * LANES) {
            for (int j = 0; j < LANES; j++)
                for (int w = 0; w < 4; w++)
                    out[start + 4 * j + w] = (float)(c[w][j] >> 8) * scale;
        } else {
            for (int64_t o = 0; o < left; o++)
                out[start + o] = (float)(c[o % 4][o / 4] >> 8) * scale;
        }
    }
}

/* out[((z * rows + i) * cols + j) * 4 + w]: word w of Philox4x32 in `rounds` rounds on the
 * counter (z, i, stream, j) for every plane z < planes, row i < rows and column j < cols. */
__attribute__((target_clones("avx2", "default")))
void seqfast_philox_grid(const int64_t *seed, uint32_t stream, int32_t rounds, int64_t planes,
                         int64_t rows, int64_t cols, uint32_t *out) {
    const uint64_t key = (uint64_t)seed[0];
    uint32_t c[4][LANES];
    for (int64_t z = 0; z < planes; z++) {
        for (int64_t i = 0; i < rows; i++) {
            uint32_t *row = out + (z * rows + i) * cols * 4;
            for (int64_t start = 0; start < cols; start += LANES) {
                for (int j = 0; j < LANES; j++) {
                    c[0][j] = (uint32_t)z;
                    c[1][j] = (uint32_t)i;
                    c[2][j] = stream;
                    c[3][j] = (uint32_t)(start + j);
                }
                philox_rounds((uint32_t)key, (uint32_t)(key >> 32), rounds, c);
                int64_t left = cols - start < LANES ? cols - start : LANES;
                for (int j = 0; j < left; j++)
                    for (int w = 0; w < 4; w++)
                        row[(start + j) * 4 + w] = c[w][j];
            }
        }
    }
}
