/* radixlm's CPU kernels: the few steps of a decode where torch's per-op cost (several us per small op) is most
   of the work on a small model. Built and cached by cpu.py (gcc -O3 -march=native -fopenmp), called through
   ctypes; each has a torch reference in cpu.py that the tests hold it to.

   Threads: OpenMP, which resolves to the libgomp torch has already loaded (same soname), so one pool serves
   both. Only q8_gemm and decode_attention are big enough to split; the rest run on the calling thread.
   bf16 is handled as uint16 bit patterns, rounded to nearest even as torch rounds. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t r = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : r; /* NaN stays NaN */
}

/* exp(x) to ~2 ulp, branch- and call-free so that loops over it vectorize (libm's expf is a scalar call):
   Cephes' expf polynomial after a Cody-Waite reduction by ln 2; n rounded with the 1.5 * 2^23 trick (no
   rintf call). x is clamped to [-87, 88], where 2^n stays a normal float. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    union { int32_t i; float f; } s = {.i = ((int32_t)n + 127) << 23};
    return p * s.f;
}

/* ---- RMSNorm with the residual add: res += add (bf16 or fp32, or nothing), out = norm(res) * w ---------- */
void add_rmsnorm(float *res, const void *add, int add_bf16, const float *w, float eps, int64_t T, int64_t H,
                 void *out, int out_bf16) {
    for (int64_t t = 0; t < T; t++) {
        float *r = res + t * H;
        if (add != NULL && add_bf16) {
            const uint16_t *a = (const uint16_t *)add + t * H;
            for (int64_t i = 0; i < H; i++) r[i] += bf16_to_f32(a[i]);
        } else if (add != NULL) {
            const float *a = (const float *)add + t * H;
            for (int64_t i = 0; i < H; i++) r[i] += a[i];
        }
        float part[16] = {0}; /* 16 independent lanes: vectorizes without reassociating one sum */
        int64_t i = 0;
        for (; i + 16 <= H; i += 16)
            for (int j = 0; j < 16; j++) part[j] += r[i + j] * r[i + j];
        float ss = 0.0f;
        for (; i < H; i++) ss += r[i] * r[i];
        for (int j = 0; j < 16; j++) ss += part[j];
        const float rstd = 1.0f / sqrtf(ss / (float)H + eps);
        if (out_bf16) {
            uint16_t *o = (uint16_t *)out + t * H;
            for (int64_t k = 0; k < H; k++) o[k] = f32_to_bf16(r[k] * rstd * w[k]);
        } else {
            float *o = (float *)out + t * H;
            for (int64_t k = 0; k < H; k++) o[k] = r[k] * rstd * w[k];
        }
    }
}

/* ---- rotary (rotate-half) on q and k of a fused qkv row, k and v stored into the pool ---------------------
   qkv [T, (H + 2 KVH) D] (bf16 or fp32, row stride ld), cos_sin [P, D] fp32 (cos | sin halves, row stride
   cs_ld), q_out [T, H, D] fp32, caches [slots, KVH, D] fp32, loc [T] the KV slot of each token. */
void rope_store(const void *qkv, int qkv_bf16, int64_t ld, const int64_t *pos, const float *cos_sin,
                int64_t cs_ld, float *q_out, float *k_cache, float *v_cache, const int64_t *loc, int64_t T,
                int64_t H, int64_t KVH, int64_t D) {
    const int64_t half = D / 2, width = (H + 2 * KVH) * D;
    float row[width];
    for (int64_t t = 0; t < T; t++) {
        if (qkv_bf16) {
            const uint16_t *src = (const uint16_t *)qkv + t * ld;
            for (int64_t i = 0; i < width; i++) row[i] = bf16_to_f32(src[i]);
        } else {
            memcpy(row, (const float *)qkv + t * ld, width * sizeof(float));
        }
        const float *c = cos_sin + pos[t] * cs_ld, *s = c + half;
        for (int64_t head = 0; head < H + KVH; head++) {
            const float *x = row + head * D;
            float *dst = head < H ? q_out + (t * H + head) * D : k_cache + (loc[t] * KVH + head - H) * D;
            for (int64_t i = 0; i < half; i++) {
                dst[i] = x[i] * c[i] - x[i + half] * s[i];
                dst[i + half] = x[i + half] * c[i] + x[i] * s[i];
            }
        }
        memcpy(v_cache + loc[t] * KVH * D, row + (H + KVH) * D, KVH * D * sizeof(float));
    }
}

/* ---- decode attention straight from the paged pool, one query token per request ---------------------------
   q [B, H, D] fp32 (row stride q_ld), caches [slots, KVH, D] fp32, req_to_token [rows, r2t_ld] int32, request
   b's keys are the slots req_to_token[rows[b], :seq_lens[b]]; out [B, H, D] fp32. No padding: each request
   reads its own length. D % 16 == 0 (checked by the caller). One task per (request, kv head): the group's
   query heads run one after another, so the kv head's rows come from L1/L2 after the first. */

/* softmax of sc[0..L) in place (unnormalized: exp(s - max)); returns the sum */
static float softmax_unnorm(float *sc, int64_t L, float m) {
    for (int64_t l = 0; l < L; l++) sc[l] = exp_approx(sc[l] - m);
    float part[16] = {0}, sum = 0.0f; /* 16 independent lanes: vectorizes without reassociating one sum */
    int64_t l = 0;
    for (; l + 16 <= L; l += 16)
        for (int j = 0; j < 16; j++) part[j] += sc[l + j];
    for (; l < L; l++) sum += sc[l];
    for (int j = 0; j < 16; j++) sum += part[j];
    return sum;
}

#ifdef __AVX512F__
#define ND_MAX 16 /* head_dim <= 256 */
/* One query head; ND = D / 16 a constant after inlining, so q and the output stay in registers. */
static inline __attribute__((always_inline)) void attend_head(int ND, const float *qh, const float *k_cache,
                                                              const float *v_cache, const int32_t *slots,
                                                              int64_t L, int64_t KVH, int64_t kvh, float scale,
                                                              float *sc, float *o) {
    const int64_t D = 16 * ND;
    __m512 qv[ND_MAX], ov[ND_MAX];
    for (int c = 0; c < ND; c++) qv[c] = _mm512_loadu_ps(qh + 16 * c);
    float m = -INFINITY;
    for (int64_t l = 0; l < L; l++) {
        const float *k = k_cache + ((int64_t)slots[l] * KVH + kvh) * D;
        __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
        for (int c = 1; c < ND; c++) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), acc);
        sc[l] = _mm512_reduce_add_ps(acc) * scale;
        m = sc[l] > m ? sc[l] : m;
    }
    const __m512 inv = _mm512_set1_ps(1.0f / softmax_unnorm(sc, L, m));
    for (int c = 0; c < ND; c++) ov[c] = _mm512_setzero_ps();
    for (int64_t l = 0; l < L; l++) {
        const float *v = v_cache + ((int64_t)slots[l] * KVH + kvh) * D;
        const __m512 p = _mm512_set1_ps(sc[l]);
        for (int c = 0; c < ND; c++) ov[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * c), ov[c]);
    }
    for (int c = 0; c < ND; c++) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(ov[c], inv));
}

static void attend(const float *qh, const float *k_cache, const float *v_cache, const int32_t *slots, int64_t L,
                   int64_t KVH, int64_t kvh, int64_t D, float scale, float *sc, float *o) {
    switch (D / 16) {
#define CASE(c) case c: attend_head(c, qh, k_cache, v_cache, slots, L, KVH, kvh, scale, sc, o); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
        CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
    }
}
#else
static void attend(const float *qh, const float *k_cache, const float *v_cache, const int32_t *slots, int64_t L,
                   int64_t KVH, int64_t kvh, int64_t D, float scale, float *sc, float *o) {
    float m = -INFINITY;
    for (int64_t l = 0; l < L; l++) {
        const float *k = k_cache + ((int64_t)slots[l] * KVH + kvh) * D;
        float lanes[16] = {0};
        for (int64_t d = 0; d < D; d += 16)
            for (int j = 0; j < 16; j++) lanes[j] += qh[d + j] * k[d + j];
        float dot = 0.0f;
        for (int j = 0; j < 16; j++) dot += lanes[j];
        sc[l] = dot * scale;
        m = sc[l] > m ? sc[l] : m;
    }
    const float inv = 1.0f / softmax_unnorm(sc, L, m);
    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
    for (int64_t l = 0; l < L; l++) {
        const float *v = v_cache + ((int64_t)slots[l] * KVH + kvh) * D;
        for (int64_t d = 0; d < D; d++) o[d] += sc[l] * v[d];
    }
    for (int64_t d = 0; d < D; d++) o[d] *= inv;
}
#endif

void decode_attention(const float *q, int64_t q_ld, const float *k_cache, const float *v_cache,
                      const int32_t *req_to_token, int64_t r2t_ld, const int64_t *rows, const int64_t *seq_lens,
                      float *out, int64_t B, int64_t H, int64_t KVH, int64_t D, float scale, int64_t max_len) {
    const int64_t group = H / KVH;
    /* Threads only when there is enough to split: a fork/join costs about as much as one short request. */
#pragma omp parallel if (B * H * max_len * D >= (1 << 17))
    {
        float *sc = (float *)malloc((size_t)(max_len > 0 ? max_len : 1) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * KVH; task++) {
            const int64_t b = task / KVH, kvh = task % KVH;
            const int32_t *slots = req_to_token + rows[b] * r2t_ld;
            for (int64_t h = kvh * group; h < (kvh + 1) * group; h++)
                attend(q + b * q_ld + h * D, k_cache, v_cache, slots, seq_lens[b], KVH, kvh, D, scale, sc,
                       out + (b * H + h) * D);
        }
        free(sc);
    }
}

/* ---- silu(gate) * up over a fused gate_up output, bf16 in and out, fp32 math rounded once ---------------- */
void silu_mul_bf16(const uint16_t *restrict gu, uint16_t *restrict out, int64_t T, int64_t I) {
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *restrict g = gu + t * 2 * I, *restrict u = g + I;
        uint16_t *restrict o = out + t * I;
        for (int64_t i = 0; i < I; i++) {
            const float x = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(x / (1.0f + exp_approx(-x)) * bf16_to_f32(u[i]));
        }
    }
}

/* ---- x @ W.T for a weight of GGUF Q8_0 blocks, read as they are -----------------------------------------
   y[m, n] = sum_j (q[n, j] * d[n, j / 32]) * x[m, j]     q: [N, K] int8, d: [N, K/32] fp32, x: [M, K] fp32
   q * d is exact in fp32 (an int8 times an fp16 scale needs 19 of fp32's 24 bits), and x, the products and
   the sums stay fp32: the fp32 GEMM over the dequantized weight up to summation order, reading 1.06 bytes
   per weight instead of 4. torch has no op for per-block int8 scales (its int8 op takes one per row). */
#ifdef __AVX512F__
#define MB 16 /* rows of x per pass: 16 accumulators + 2 weight vectors fit in the 32 zmm registers */

/* Rows n0..n1 of W against rows m0..m0+MC of x; MC a constant after inlining, so acc stays in registers. */
static inline __attribute__((always_inline)) void q8_tile(int MC, const int8_t *q, const float *d,
                                                          const float *x, float *y, int64_t m0, int64_t n0,
                                                          int64_t n1, int64_t K, int64_t ldx, int64_t ldy) {
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

static void q8_rows(const int8_t *q, const float *d, const float *x, float *y, int64_t M, int64_t n0,
                    int64_t n1, int64_t K, int64_t ldx, int64_t ldy) {
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        switch (M - m0 < MB ? M - m0 : MB) {
#define CASE(c) case c: q8_tile(c, q, d, x, y, m0, n0, n1, K, ldx, ldy); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
            CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
        }
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The same on AVX2: a block's 32 weights are four 8-lane vectors. Up to 8 rows of x per pass (8 accumulators
   + 4 weight vectors + a load fit the 16 ymm registers); with fewer rows each row gets 2 or 4 accumulators,
   so that its FMAs are not one dependent chain. */
#define MB8 8

static inline __attribute__((always_inline)) void q8_tile_avx2(int MC, const int8_t *q, const float *d,
                                                               const float *x, float *y, int64_t m0, int64_t n0,
                                                               int64_t n1, int64_t K, int64_t ldx, int64_t ldy) {
    const int64_t nb = K / 32;
    const int A = MC <= 2 ? 4 : MC <= 4 ? 2 : 1; /* accumulators per row */
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *qr = q + n * K;
        const float *dr = d + n * nb;
        const float *xr = x + m0 * ldx;
        __m256 acc[MB8][4];
        for (int i = 0; i < MC; i++)
            for (int a = 0; a < A; a++) acc[i][a] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const __m256 s = _mm256_broadcast_ss(dr + b);
            __m256 w[4];
            for (int j = 0; j < 4; j++)
                w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                         _mm_loadl_epi64((const __m128i *)(qr + 32 * b + 8 * j)))), s);
            for (int i = 0; i < MC; i++)
                for (int j = 0; j < 4; j++)
                    acc[i][j % A] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr + i * ldx + 32 * b + 8 * j),
                                                    acc[i][j % A]);
        }
        for (int i = 0; i < MC; i++) {
            __m256 v = acc[i][0];
            for (int a = 1; a < A; a++) v = _mm256_add_ps(v, acc[i][a]);
            const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
            y[(m0 + i) * ldy + n] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
        }
    }
}

static void q8_rows(const int8_t *q, const float *d, const float *x, float *y, int64_t M, int64_t n0,
                    int64_t n1, int64_t K, int64_t ldx, int64_t ldy) {
    for (int64_t m0 = 0; m0 < M; m0 += MB8) {
        switch (M - m0 < MB8 ? M - m0 : MB8) {
#define CASE(c) case c: q8_tile_avx2(c, q, d, x, y, m0, n0, n1, K, ldx, ldy); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        }
    }
}
#else
/* Portable fallback (no AVX2): the same sums, vectorized by the compiler as it can. */
static void q8_rows(const int8_t *q, const float *d, const float *x, float *y, int64_t M, int64_t n0,
                    int64_t n1, int64_t K, int64_t ldx, int64_t ldy) {
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
        q8_rows(q, d, x, y, M, n0, n1, K, ldx, ldy);
    }
}

/* ---- x @ W.T for GGUF Q4_0/Q4_1 weights on AVX-512 BF16 dot products -------------------------------------
   w[n, k] = d[n, b] * q[n, k] + m[n, b] (b = k / 32, q in 0..15; Q4_0 has m = -8 d), so
   y[m, n] = sum_b d[n, b] * sum_{k in b} q[n, k] x[m, k] + m[n, b] * sum_{k in b} x[m, k].
   x is rounded to bf16 (as torch's int4 op takes it); the nibbles are exact in bf16 and d, m stay fp16
   (exact, as in the file), every sum fp32. Output rows run in the vector lanes: one vdpbf16ps multiplies 16
   rows by a pair of k, so a block's scales are applied once per 32 k.
   Layout (q4_pack in cpu.py): qs [N/16][K/32][16 pairs][16 lanes] bytes, pair p of lane i holding
   q[16t + i, 32b + 2p] (low nibble) and q[.., 32b + 2p + 1] (high); dm [N/16][K/32][2][16] fp16 (d, then m).
   xp: [M, K/2] bf16 pairs of x, xs [M, K/32] the blocks' sums of those bf16 values (q4_prepare_x). */
/* x [M, K] fp32 -> bf16 pairs xp [M, K/2] and per-32 sums xs [M, K/32] of the rounded values. */
static void q4_prepare_x(const float *x, int64_t ldx, uint32_t *xp, float *xs, int64_t M, int64_t K) {
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * ldx;
        uint16_t *h = (uint16_t *)(xp + r * (K / 2));
        for (int64_t k = 0; k < K; k++) h[k] = f32_to_bf16(xr[k]);
        for (int64_t b = 0; b < K / 32; b++) {
            float s = 0.0f;
            for (int j = 0; j < 32; j++) s += bf16_to_f32(h[b * 32 + j]);
            xs[r * (K / 32) + b] = s;
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define Q4_MT 8 /* rows of x per pass: 8 block sums + 8 totals + the weights fit the 32 registers */

static inline __attribute__((always_inline)) void q4_tile(int MC, const uint8_t *qs, const uint16_t *dm,
                                                          const uint32_t *xp, const float *xs, float *y,
                                                          int64_t m0, int64_t t, int64_t nb, int64_t K, int64_t N,
                                                          __m512i table) {
    __m512 total[Q4_MT], blk[Q4_MT];
    for (int i = 0; i < MC; i++) total[i] = _mm512_setzero_ps();
    const uint8_t *q = qs + t * nb * 256;
    const uint16_t *sc = dm + t * nb * 32;
    for (int64_t b = 0; b < nb; b++) {
        for (int i = 0; i < MC; i++) blk[i] = _mm512_setzero_ps();
        for (int p = 0; p < 16; p++) {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + (b * 16 + p) * 16)));
            const __m512i idx = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)),
                                                _mm512_and_si512(_mm512_slli_epi32(v, 12),
                                                                 _mm512_set1_epi32(0x000F0000)));
            const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(idx, table);
            for (int i = 0; i < MC; i++) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[(m0 + i) * (K / 2) + b * 16 + p]);
                blk[i] = _mm512_dpbf16_ps(blk[i], w, xv);
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + b * 32)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + b * 32 + 16)));
        for (int i = 0; i < MC; i++) {
            total[i] = _mm512_fmadd_ps(blk[i], d, total[i]);
            total[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[(m0 + i) * nb + b]), total[i]);
        }
    }
    for (int i = 0; i < MC; i++) _mm512_storeu_ps(y + (m0 + i) * N + t * 16, total[i]);
}

int q4_gemm_available(void) { return 1; }
int q4_gemm_isa(void) { return 2; } /* 2: AVX-512 BF16, 1: AVX2, 0: none */

/* xp, xs: scratch of M * K/2 uint32 and M * K/32 floats, filled here from x (row stride ldx). */
void q4_gemm(const uint8_t *qs, const uint16_t *dm, const float *x, int64_t ldx, uint32_t *xp, float *xs, float *y,
             int64_t M, int64_t N, int64_t K) {
    const int64_t nb = K / 32;
    q4_prepare_x(x, ldx, xp, xs, M, K);
    __m512i table = _mm512_setzero_si512(); /* bf16 of 0..15 in words 0..15 */
    uint16_t tab[32] = {0};
    for (int v = 0; v < 16; v++) tab[v] = f32_to_bf16((float)v);
    table = _mm512_loadu_si512(tab);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N / 16; t++) {
        for (int64_t m0 = 0; m0 < M; m0 += Q4_MT) {
            switch (M - m0 < Q4_MT ? M - m0 : Q4_MT) {
#define CASE(c) case c: q4_tile(c, qs, dm, xp, xs, y, m0, t, nb, K, N, table); break;
                CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
            }
        }
    }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* The same sums on AVX2 (+ FMA, F16C): a tile's 16 rows are two ymm halves (lanes 0-7, 8-15 of the packed
   tile). Each pair's 16 bytes become four fp32 vectors (even k, odd k; each half): zero-extend to int32, mask
   or shift out the nibble, convert (exact). x is taken as fp32 copies of its bf16-rounded values, broadcast one
   k at a time, so every product q x is exact in fp32 (a 4-bit integer times an 8-bit mantissa) and a block's
   sums are the ones the AVX-512 kernel forms; d and m are applied once per block as there.
   Up to Q4_MT rows of x per pass share each unpacked weight vector (unpacking costs as much as the FMAs of
   about two rows). Accumulators: 2 halves per row, split further by k (even/odd k, and pair parity for one
   row) so that 6-8 independent FMA chains hide the FMA latency; at 4 rows the 8 accumulators, the 4 weight
   vectors and the broadcasts fill the 16 ymm registers (the block totals, touched once per 32 k, may stay
   in L1). */
#define Q4_MT 4

/* x [M, K] fp32 -> xf [M, K] its values rounded to bf16 (kept as fp32), xs [M, K/32] their block sums. */
static void q4_prepare_x_f32(const float *x, int64_t ldx, float *xf, float *xs, int64_t M, int64_t K) {
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * ldx;
        float *f = xf + r * K;
        for (int64_t k = 0; k < K; k++) f[k] = bf16_to_f32(f32_to_bf16(xr[k]));
        for (int64_t b = 0; b < K / 32; b++) {
            float s = 0.0f;
            for (int j = 0; j < 32; j++) s += f[b * 32 + j];
            xs[r * (K / 32) + b] = s;
        }
    }
}

/* One 16-row tile (q, sc: its packed blocks and scales) against rows m0..m0+MC of x; y is the tile's first
   column of row 0. MC a constant after inlining, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void q4_tile_avx2(int MC, const uint8_t *q, const uint16_t *sc,
                                                               const float *xf, const float *xs, float *y,
                                                               int64_t m0, int64_t nb, int64_t K, int64_t N) {
    const __m256i lo = _mm256_set1_epi32(0x0F);
    const int S = MC == 1 ? 4 : MC == 2 ? 2 : 1; /* accumulator sets per row: chains = 2 MC S */
    __m256 tot[Q4_MT][2], acc[Q4_MT][4][2];
    for (int i = 0; i < MC; i++) tot[i][0] = tot[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        for (int i = 0; i < MC; i++)
            for (int c = 0; c < S; c++) acc[i][c][0] = acc[i][c][1] = _mm256_setzero_ps();
        const uint8_t *qb = q + b * 256;
#pragma GCC unroll 16
        for (int p = 0; p < 16; p++) {
            const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qb + p * 16)));
            const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qb + p * 16 + 8)));
            const __m256 we0 = _mm256_cvtepi32_ps(_mm256_and_si256(v0, lo));
            const __m256 we1 = _mm256_cvtepi32_ps(_mm256_and_si256(v1, lo));
            const __m256 wo0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4));
            const __m256 wo1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));
            const int ce = (2 * p) % S, co = (2 * p + 1) % S;
            for (int i = 0; i < MC; i++) {
                const float *xk = xf + (m0 + i) * K + b * 32 + 2 * p;
                const __m256 xe = _mm256_broadcast_ss(xk), xo = _mm256_broadcast_ss(xk + 1);
                acc[i][ce][0] = _mm256_fmadd_ps(we0, xe, acc[i][ce][0]);
                acc[i][ce][1] = _mm256_fmadd_ps(we1, xe, acc[i][ce][1]);
                acc[i][co][0] = _mm256_fmadd_ps(wo0, xo, acc[i][co][0]);
                acc[i][co][1] = _mm256_fmadd_ps(wo1, xo, acc[i][co][1]);
            }
        }
        const uint16_t *s = sc + b * 32;
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 8)));
        const __m256 n0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16)));
        const __m256 n1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 24)));
        for (int i = 0; i < MC; i++) {
            for (int c = 1; c < S; c++) {
                acc[i][0][0] = _mm256_add_ps(acc[i][0][0], acc[i][c][0]);
                acc[i][0][1] = _mm256_add_ps(acc[i][0][1], acc[i][c][1]);
            }
            const __m256 sum = _mm256_broadcast_ss(xs + (m0 + i) * nb + b);
            tot[i][0] = _mm256_fmadd_ps(n0, sum, _mm256_fmadd_ps(acc[i][0][0], d0, tot[i][0]));
            tot[i][1] = _mm256_fmadd_ps(n1, sum, _mm256_fmadd_ps(acc[i][0][1], d1, tot[i][1]));
        }
    }
    for (int i = 0; i < MC; i++) {
        _mm256_storeu_ps(y + (m0 + i) * N, tot[i][0]);
        _mm256_storeu_ps(y + (m0 + i) * N + 8, tot[i][1]);
    }
}

int q4_gemm_available(void) { return 1; }
int q4_gemm_isa(void) { return 1; }

/* xp, xs: scratch of M * K floats and M * K/32 floats, filled here from x (row stride ldx). Tiles of 16
   output rows are split across the threads; each runs x's rows against it in passes of at most Q4_MT, the
   passes balanced (17 rows: 3 + 3 + 3 + 4 + 4, not 4 x 4 + 1), and its packed blocks stay in L1 between
   passes. */
void q4_gemm(const uint8_t *qs, const uint16_t *dm, const float *x, int64_t ldx, uint32_t *xp, float *xs, float *y,
             int64_t M, int64_t N, int64_t K) {
    const int64_t nb = K / 32, passes = (M + Q4_MT - 1) / Q4_MT;
    float *xf = (float *)xp;
    q4_prepare_x_f32(x, ldx, xf, xs, M, K);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N / 16; t++) {
        for (int64_t r = 0, m0 = 0; r < passes; r++) {
            const int64_t mc = (M - m0) / (passes - r);
            switch (mc) {
#define CASE(c) case c: q4_tile_avx2(c, qs + t * nb * 256, dm + t * nb * 32, xf, xs, y + t * 16, m0, nb, K, N); break;
                CASE(1) CASE(2) CASE(3) CASE(4)
#undef CASE
            }
            m0 += mc;
        }
    }
}
#else
int q4_gemm_available(void) { return 0; }
int q4_gemm_isa(void) { return 0; }

void q4_gemm(const uint8_t *qs, const uint16_t *dm, const float *x, int64_t ldx, uint32_t *xp, float *xs, float *y,
             int64_t M, int64_t N, int64_t K) {
    /* callers check q4_gemm_available() first */
    (void)qs, (void)dm, (void)x, (void)ldx, (void)xp, (void)xs, (void)y, (void)M, (void)N, (void)K;
}
#endif
