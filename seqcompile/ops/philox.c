/* The dropout stream's numbers on CPU (seqcompile/ops/random.py defines the stream): the element
 * at flat offset o takes word o % 4 of Philox4x32-10 on the counter (o / 4 low word, o / 4 high
 * word, stream, 0) under the 64-bit key seed, and the word's top 24 bits as a float in [0, 1).
 * Blocks are computed LANES at a time, so the compiler can run the rounds in vector registers. */
#include <stdint.h>

#define LANES 16

static inline __attribute__((always_inline)) void philox_blocks(uint32_t k0, uint32_t k1, uint64_t first, uint32_t stream,
                          uint32_t words[4][LANES]) {
    uint32_t c0[LANES], c1[LANES], c2[LANES], c3[LANES];
    for (int j = 0; j < LANES; j++) {
        uint64_t block = first + (uint64_t)j;
        c0[j] = (uint32_t)block;
        c1[j] = (uint32_t)(block >> 32);
        c2[j] = stream;
        c3[j] = 0;
    }
    for (int round = 0; round < 10; round++) {
        for (int j = 0; j < LANES; j++) {
            uint64_t a = (uint64_t)0xD2511F53u * c0[j];
            uint64_t b = (uint64_t)0xCD9E8D57u * c2[j];
            uint32_t n0 = (uint32_t)(b >> 32) ^ c1[j] ^ k0;
            uint32_t n2 = (uint32_t)(a >> 32) ^ c3[j] ^ k1;
            c1[j] = (uint32_t)b;
            c3[j] = (uint32_t)a;
            c0[j] = n0;
            c2[j] = n2;
        }
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    for (int j = 0; j < LANES; j++) {
        words[0][j] = c0[j];
        words[1][j] = c1[j];
        words[2][j] = c2[j];
        words[3][j] = c3[j];
    }
}

/* out[o] for o in [0, count): the stream's numbers from offset 0. Built for AVX2 and for the
 * baseline instruction set; the loader picks the one this CPU runs. */
__attribute__((target_clones("avx2", "default")))
void seqfast_philox_uniforms(const int64_t *seed, uint32_t stream, int64_t count, float *out) {
    const uint64_t key = (uint64_t)seed[0];
    const uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    const float scale = 1.0f / 16777216.0f;
    uint32_t words[4][LANES];
    for (int64_t start = 0; start < count; start += 4 * LANES) {
        philox_blocks(k0, k1, (uint64_t)start / 4, stream, words);
        int64_t left = count - start;
        if (left >= 4 * LANES) {
            for (int j = 0; j < LANES; j++)
                for (int w = 0; w < 4; w++)
                    out[start + 4 * j + w] = (float)(words[w][j] >> 8) * scale;
        } else {
            for (int64_t o = 0; o < left; o++)
                out[start + o] = (float)(words[o % 4][o / 4] >> 8) * scale;
        }
    }
}
