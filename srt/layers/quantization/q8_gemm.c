/* x @ W.T for a weight of GGUF Q8_0 blocks, read as they are (int8 q, one scale d per 32 along K).

   y[m, n] = sum_j (q[n, j] * d[n, j / 32]) * x[m, j]     q: [N, K] int8, d: [N, K/32] fp32, x: [M, K] fp32

   q * d is exact in fp32 (an int8 times an fp16 scale needs 19 of fp32's 24 bits), and x, the products and
   the sums stay fp32: the result is the fp32 GEMM over the dequantized weight, up to summation order, while
   reading 1.06 bytes per weight instead of 4. torch has no op for per-block int8 scales (its int8
   weight-only op takes one scale per row). Built and cached by cpu_ext.py; threads through OpenMP, which
   resolves to the libgomp torch has already loaded (same soname), so the two share one thread pool. */
#include <stdint.h>

#ifdef __AVX512F__
#include <immintrin.h>

#define MB 16 /* rows of x per pass: 16 accumulators + 2 weight vectors fit in the 32 zmm registers */

/* Rows n0..n1 of W against rows m0..m0+MC of x; MC a constant after inlining, so acc stays in registers. */
static inline __attribute__((always_inline)) void tile(int MC, const int8_t *q, const float *d, const float *x,
                                                       float *y, int64_t m0, int64_t n0, int64_t n1, int64_t K,
                                                       int64_t ldx, int64_t ldy) {
    const int64_t nb = K / 32;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *qr = q + n * K;
        const float *dr = d + n * nb;
        const float *xr = x + m0 * ldx;
        __m512 acc[MB];
        for (int i = 0; i < MC; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const __m512 s = _mm512_set1_ps(dr[b]);
            const __m128i *qb = (const __m128i *)(qr + 32 * b);
            const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qb))), s);
            const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qb + 1))), s);
            for (int i = 0; i < MC; i++) {
                const float *xb = xr + i * ldx + 32 * b;
                acc[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc[i]);
                acc[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), acc[i]);
            }
        }
        for (int i = 0; i < MC; i++) y[(m0 + i) * ldy + n] = _mm512_reduce_add_ps(acc[i]);
    }
}

static void rows(const int8_t *q, const float *d, const float *x, float *y, int64_t M, int64_t n0, int64_t n1,
                 int64_t K, int64_t ldx, int64_t ldy) {
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        switch (M - m0 < MB ? M - m0 : MB) {
#define CASE(c) case c: tile(c, q, d, x, y, m0, n0, n1, K, ldx, ldy); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
            CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
        }
    }
}
#else
/* Portable fallback (no AVX-512): the same sums, vectorized by the compiler as it can. */
static void rows(const int8_t *q, const float *d, const float *x, float *y, int64_t M, int64_t n0, int64_t n1,
                 int64_t K, int64_t ldx, int64_t ldy) {
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < K; j++) acc += (float)q[n * K + j] * d[n * (K / 32) + j / 32] * x[m * ldx + j];
            y[m * ldy + n] = acc;
        }
    }
}
#endif

int q8_gemm_avx512(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* Rows of W are split across the threads in chunks of 64 (each chunk's q rows stay in L1 across x's rows). */
void q8_gemm(const int8_t *q, const float *d, const float *x, float *y, int64_t M, int64_t N, int64_t K,
             int64_t ldx, int64_t ldy) {
    const int64_t chunks = (N + 63) / 64;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * 64, n1 = n0 + 64 < N ? n0 + 64 : N;
        rows(q, d, x, y, M, n0, n1, K, ldx, ldy);
    }
}
