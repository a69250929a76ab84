/* sparsespec CPU kernels: the decode step's linears, attention and small fused ops, fp32.
 *
 * Built at load by sparsespec/kernels/cpu.py with the machine's C compiler (-O3 -march=native
 * -fopenmp -ffp-contract=off) and called through ctypes; OpenMP is the libgomp that torch has
 * already loaded (same soname), so these kernels and torch's share one thread pool.
 *
 * Numerics: every output element is computed by a fixed sequence of operations that depends only
 * on its own inputs, never on how many rows share the call or which thread runs it:
 *   - a dot product over K runs in one 8-lane FMA chain (k = 0, 8, 16, ...), reduced by the tree
 *     ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)), then the scalar tail in order;
 *   - attention splits each row's keys into chunks of SS_CHUNK keys at fixed key offsets; the
 *     row max, the exp-sums and the P.V partials are combined in chunk order.
 * So a row decoded alone, in a batch, or as one of the k + 1 queries of a verify gets bitwise
 * the same logits (batch and width invariance): greedy speculation reproduces AR exactly.
 *
 * Layouts (all float32, innermost dimension contiguous):
 *   linear     x [M, K] (row stride ldx), W [N, K] (row stride ldw), y [M, N] (row stride ldy)
 *   attention  q [B, H_kv * G, T, D] contiguous (query row r = g * T + t of KV head kv);
 *              k, v: one layer's cache, element (b, kv, s, d) at b * sb + kv * sh + s * D + d;
 *              out: element (b, h, t, d) at b * ob + t * ot + h * D + d (e.g. [B, T, H * D]).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <immintrin.h>

#define SS_API __attribute__((visibility("default")))
#define SS_INLINE static inline __attribute__((always_inline))
#define SS_CHUNK 256
/* Prefetch tunables of the attention's score loop, the values measured best on the Xeon of
 * benchmarks/RESULTS.md (override with -D for an experiment): value rows into L2 every SS_VPF_STEP
 * bytes; the keys SS_KPF_DIST positions ahead (0: none) into L1 every SS_KPF_STEP bytes. Every 64
 * bytes beat every 128 (10-30 % at T = 1-9), 8 keys ahead beat 16, 32 and 64. */
#ifndef SS_VPF_STEP
#define SS_VPF_STEP 64
#endif
#ifndef SS_KPF_DIST
#define SS_KPF_DIST 8
#endif
#ifndef SS_KPF_STEP
#define SS_KPF_STEP 64
#endif
#ifndef SS_R512_MIN
#define SS_R512_MIN 4  /* fewest query rows of a (b, kv) pair for the AVX-512 score tiles */
#endif

#if !defined(__AVX2__) || !defined(__FMA__)
#error "sparsespec_cpu.c needs AVX2 and FMA (the loader falls back to torch without them)"
#endif

SS_API int ss_abi_version(void) { return 19; }


/* ------------------------------------------------------------------ vector helpers (AVX2) */
/* ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)): the reduction tree every dot product uses. */
SS_INLINE float hsum8(__m256 v) {
    __m256 h = _mm256_hadd_ps(v, v);  /* l01 l23 l01 l23 | l45 l67 l45 l67 */
    h = _mm256_hadd_ps(h, h);         /* l0123 ...        | l4567 ...       */
    __m128 s = _mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    return _mm_cvtss_f32(s);
}

/* Eight reductions at once, each with hsum8's tree: out[i] = hsum8(a[i]). */
SS_INLINE __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                         __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20), hi = _mm256_permute2f128_ps(u0, u1, 0x31);
    return _mm256_add_ps(lo, hi);
}

/* exp(x) for x <= 0 (softmax) or any x (silu), Cephes' single-precision polynomial (about 1 ulp);
 * x below -87.3 gives exactly 0 (so masked scores, -inf, give probability 0). */
SS_INLINE __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.33654475f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(x, hi);
    x = _mm256_max_ps(x, lo);
    __m256 fx = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, z, x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i n = _mm256_cvttps_epi32(fx);
    n = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(n));
    return _mm256_andnot_ps(under, y);
}

SS_INLINE float exp1(float x) {
    float buf[8] = {x, 0, 0, 0, 0, 0, 0, 0};
    _mm256_storeu_ps(buf, exp8(_mm256_loadu_ps(buf)));
    return buf[0];
}

static int ss_threads(int nt) { return nt > 0 ? nt : omp_get_max_threads(); }

/* ------------------------------------------------------------------ linear (AVX2) */
/* One tile: MR rows of x against NR rows of W; each (m, n) is one 8-lane FMA chain + hsum8 + tail. */
SS_INLINE void lin_tile8(const int MR, const int NR, int64_t K, const float *x, int64_t ldx, const float *w,
                         int64_t ldw, float *y, int64_t ldy, const float *bias, int acc) {
    __m256 a[4][4];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) a[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[4];
        for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * ldw + k);
        for (int i = 0; i < MR; ++i) {
            __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
            for (int j = 0; j < NR; ++j) a[i][j] = _mm256_fmadd_ps(xv, wv[j], a[i][j]);
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) {
            float s = hsum8(a[i][j]);
            for (int64_t kk = k; kk < K; ++kk) s += x[i * ldx + kk] * w[j * ldw + kk];
            if (bias) s += bias[j];
            if (acc) y[i * ldy + j] += s; else y[i * ldy + j] = s;
        }
}

/* The MR x NR kernels as constants (the compiler keeps the accumulators in registers). */
#define LIN_CASE(MR_, NR_) lin_tile8(MR_, NR_, K, xm, ldx, wn, ldw, ym, ldy, bn, acc)
static void lin_tile_dispatch(int mr, int nr, int64_t K, const float *xm, int64_t ldx, const float *wn, int64_t ldw,
                              float *ym, int64_t ldy, const float *bn, int acc) {
    switch (mr * 8 + nr) {
        case 4 * 8 + 3: LIN_CASE(4, 3); break;
        case 4 * 8 + 2: LIN_CASE(4, 2); break;
        case 4 * 8 + 1: LIN_CASE(4, 1); break;
        case 3 * 8 + 3: LIN_CASE(3, 3); break;
        case 3 * 8 + 2: LIN_CASE(3, 2); break;
        case 3 * 8 + 1: LIN_CASE(3, 1); break;
        case 2 * 8 + 4: LIN_CASE(2, 4); break;
        case 2 * 8 + 3: LIN_CASE(2, 3); break;
        case 2 * 8 + 2: LIN_CASE(2, 2); break;
        case 2 * 8 + 1: LIN_CASE(2, 1); break;
        case 1 * 8 + 4: LIN_CASE(1, 4); break;
        case 1 * 8 + 3: LIN_CASE(1, 3); break;
        case 1 * 8 + 2: LIN_CASE(1, 2); break;
        default: LIN_CASE(1, 1); break;
    }
}

/* y[M, N] (=|+=) x[M, K] @ W[N, K]^T (+ bias). Threads split N in contiguous ranges; each W tile
 * (NR rows) is read from memory once and reused from L1 for every row of x. */
SS_API void ss_linear(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const float *w, int64_t ldw,
                      const float *bias, float *y, int64_t ldy, int acc, int nthreads) {
    const int NR = M == 1 ? 4 : (M == 2 ? 4 : 3);
    const int MR = M == 2 ? 2 : 4;
    int64_t ntiles = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(ss_threads(nthreads))
    for (int64_t t = 0; t < ntiles; ++t) {
        int64_t n0 = t * NR;
        int nr = (int)(N - n0 < NR ? N - n0 : NR);
        const float *wn = w + n0 * ldw;
        const float *bn = bias ? bias + n0 : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            int mr = (int)(M - m0 < MR ? M - m0 : MR);
            lin_tile_dispatch(mr, nr, K, x + m0 * ldx, ldx, wn, ldw, y + m0 * ldy + n0, ldy, bn, acc);
        }
    }
}

/* ------------------------------------------------------------------ packed linear (AVX2)
 * W packed in panels of 16 output columns: Wp[p][k][c] = W[16 p + c][k] (zero past N), so a panel
 * streams contiguously. Outer-product micro-kernel (BLIS-style): MR rows of x broadcast one at a
 * time against the panel's two vectors; y[m, n] is one FMA chain over k = 0 .. K-1 in order, so
 * again independent of the tile shape, of M and of the threads. */
#define SS_NB 16
#ifndef SS_PF_DIST
#define SS_PF_DIST 16  /* rows of a panel prefetched ahead of the first row tile */
#endif
/* The same distance where the rows take two or more row tiles (a verify's widths): a speed choice
 * (the same results) measured at load by the kernel plan's trial (ss_set_linear_wide_prefetch). On
 * the AMD EPYC without AVX-512 of benchmarks/RESULTS.md 128 rows made SmolLM2's linears 1.16-1.19x
 * faster at M = 9 and was 3-6 % slower in one tile (M = 1-4), hence a distance of its own. */
static int64_t ss_lin_pf_wide = SS_PF_DIST;

/* Set how many rows of a panel the first of two or more row tiles fetches ahead (at most 1024);
 * returns the setting. Call between kernels only. */
SS_API int ss_set_linear_wide_prefetch(int rows) {
    ss_lin_pf_wide = rows < 0 ? 0 : rows > 1024 ? 1024 : rows;
    return (int)ss_lin_pf_wide;
}

/* one row of 16 outputs (accumulators passed by value: an escaping address would keep them in memory) */
SS_INLINE void pk_store_row(__m256 c0, __m256 c1, float *yr, const float *bias, int acc, int ncols) {
    if (ncols == SS_NB) {  /* (the loop below, by element, compiles to calls to memcpy) */
        if (bias) {
            c0 = _mm256_add_ps(c0, _mm256_loadu_ps(bias));
            c1 = _mm256_add_ps(c1, _mm256_loadu_ps(bias + 8));
        }
        if (acc) {
            c0 = _mm256_add_ps(_mm256_loadu_ps(yr), c0);
            c1 = _mm256_add_ps(_mm256_loadu_ps(yr + 8), c1);
        }
        _mm256_storeu_ps(yr, c0);
        _mm256_storeu_ps(yr + 8, c1);
        return;
    }
    float v[16];
    _mm256_storeu_ps(v, c0);
    _mm256_storeu_ps(v + 8, c1);
    for (int u = 0; u < ncols; ++u) {
        float s = v[u];
        if (bias) s += bias[u];
        if (acc) yr[u] += s; else yr[u] = s;
    }
}

/* MR (1..6) rows x one panel. Named accumulators (not an array: GCC keeps arrays of vectors in
 * memory here, storing 12 accumulators to the stack on every k). */
#define PK_ROW(i)                                                      \
    if (MR > i) {                                                      \
        __m256 xb = _mm256_broadcast_ss(x + i * ldx + k);              \
        c##i##0 = _mm256_fmadd_ps(xb, w0, c##i##0);                    \
        c##i##1 = _mm256_fmadd_ps(xb, w1, c##i##1);                    \
    }
#define PK_OUT(i) \
    if (MR > i) pk_store_row(c##i##0, c##i##1, y + i * ldy, bias, acc, ncols);
/* y[MR, 16] (=|+=) x[MR, K] . w[K, 16], w's rows ldw apart (SS_NB for a packed weight panel; D for
 * value rows of the attention); pf: prefetch line k of the stream pfw (rows ldw apart) at step k:
 * the panel's own stream 16 rows ahead (weights from memory), or the next panel while a later
 * row tile reuses this one from cache (the memory stream then never stops for compute) */
SS_INLINE void gemm_tile(const int MR, int64_t K, const float *x, int64_t ldx, const float *wp, int64_t ldw,
                         float *y, int64_t ldy, const float *bias, int acc, int ncols, const int pf,
                         const float *pfw) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < K; ++k) {
        /* measured: 5-15 % at 4-16 rows, nothing at 1-2 */
        if (pf) _mm_prefetch((const char *)(pfw + k * ldw), _MM_HINT_T0);
        __m256 w0 = _mm256_loadu_ps(wp + k * ldw), w1 = _mm256_loadu_ps(wp + k * ldw + 8);
        __asm__("" : "+x"(w0), "+x"(w1));  /* in registers, not one load per FMA (pk512_tile) */
        PK_ROW(0) PK_ROW(1) PK_ROW(2) PK_ROW(3) PK_ROW(4) PK_ROW(5)
    }
    PK_OUT(0) PK_OUT(1) PK_OUT(2) PK_OUT(3) PK_OUT(4) PK_OUT(5)
}

SS_INLINE void pk_tile(const int MR, int64_t K, const float *x, int64_t ldx, const float *wp, float *y, int64_t ldy,
                       const float *bias, int acc, int ncols, const float *pfw) {
    gemm_tile(MR, K, x, ldx, wp, SS_NB, y, ldy, bias, acc, ncols, 1, pfw);
}

/* rows 0 .. M-1 of x against one 16-column panel, in blocks of 6 (tails 1..5) */
static void gemm_rows(int64_t M, int64_t K, const float *x, int64_t ldx, const float *wp, int64_t ldw, float *y,
                      int64_t ldy, int acc, int ncols) {
    int64_t m = 0;
    for (; m + 6 <= M; m += 6) gemm_tile(6, K, x + m * ldx, ldx, wp, ldw, y + m * ldy, ldy, NULL, acc, ncols, 0, NULL);
    switch (M - m) {
        case 5: gemm_tile(5, K, x + m * ldx, ldx, wp, ldw, y + m * ldy, ldy, NULL, acc, ncols, 0, NULL); break;
        case 4: gemm_tile(4, K, x + m * ldx, ldx, wp, ldw, y + m * ldy, ldy, NULL, acc, ncols, 0, NULL); break;
        case 3: gemm_tile(3, K, x + m * ldx, ldx, wp, ldw, y + m * ldy, ldy, NULL, acc, ncols, 0, NULL); break;
        case 2: gemm_tile(2, K, x + m * ldx, ldx, wp, ldw, y + m * ldy, ldy, NULL, acc, ncols, 0, NULL); break;
        case 1: gemm_tile(1, K, x + m * ldx, ldx, wp, ldw, y + m * ldy, ldy, NULL, acc, ncols, 0, NULL); break;
        default: break;
    }
}

/* MR (1..2) rows x two panels: more independent chains and two streams for the narrow cases */
SS_INLINE void pk_tile2(const int MR, int64_t K, const float *x, int64_t ldx, const float *wp, int64_t panel,
                        float *y, int64_t ldy, const float *bias, int acc, int ncols2) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00;
    __m256 d00 = c00, d01 = c00, d10 = c00, d11 = c00;
    const float *wq = wp + panel;
    for (int64_t k = 0; k < K; ++k) {
        __m256 w0 = _mm256_loadu_ps(wp + k * SS_NB), w1 = _mm256_loadu_ps(wp + k * SS_NB + 8);
        __m256 w2 = _mm256_loadu_ps(wq + k * SS_NB), w3 = _mm256_loadu_ps(wq + k * SS_NB + 8);
        __asm__("" : "+x"(w0), "+x"(w1), "+x"(w2), "+x"(w3));
        __m256 x0 = _mm256_broadcast_ss(x + k);
        c00 = _mm256_fmadd_ps(x0, w0, c00); c01 = _mm256_fmadd_ps(x0, w1, c01);
        d00 = _mm256_fmadd_ps(x0, w2, d00); d01 = _mm256_fmadd_ps(x0, w3, d01);
        if (MR > 1) {
            __m256 x1 = _mm256_broadcast_ss(x + ldx + k);
            c10 = _mm256_fmadd_ps(x1, w0, c10); c11 = _mm256_fmadd_ps(x1, w1, c11);
            d10 = _mm256_fmadd_ps(x1, w2, d10); d11 = _mm256_fmadd_ps(x1, w3, d11);
        }
    }
    pk_store_row(c00, c01, y, bias, acc, SS_NB);
    pk_store_row(d00, d01, y + SS_NB, bias ? bias + SS_NB : NULL, acc, ncols2);
    if (MR > 1) {
        pk_store_row(c10, c11, y + ldy, bias, acc, SS_NB);
        pk_store_row(d10, d11, y + ldy + SS_NB, bias ? bias + SS_NB : NULL, acc, ncols2);
    }
}

/* rows 0 .. M-1 against one panel, in balanced tiles of at most 6 rows (9 = 5 + 4, not 6 + 3: a
 * tile of 3 has too few independent FMA chains to hide the FMA latency) */
SS_INLINE void pk_tile_n(int mr, int64_t K, const float *x, int64_t ldx, const float *wp, float *y, int64_t ldy,
                         const float *bias, int acc, int ncols, const float *pfw) {
    switch (mr) {
        case 6: pk_tile(6, K, x, ldx, wp, y, ldy, bias, acc, ncols, pfw); break;
        case 5: pk_tile(5, K, x, ldx, wp, y, ldy, bias, acc, ncols, pfw); break;
        case 4: pk_tile(4, K, x, ldx, wp, y, ldy, bias, acc, ncols, pfw); break;
        case 3: pk_tile(3, K, x, ldx, wp, y, ldy, bias, acc, ncols, pfw); break;
        case 2: pk_tile(2, K, x, ldx, wp, y, ldy, bias, acc, ncols, pfw); break;
        default: pk_tile(1, K, x, ldx, wp, y, ldy, bias, acc, ncols, pfw); break;
    }
}

/* The first row tile streams the panel (prefetching 16 rows ahead); every later tile reuses it
 * from cache and prefetches the next panel (the memory stream then overlaps all the compute: at
 * 7-12 rows, 5 + 4 or 6 + 6, the second tile alone would otherwise leave the memory idle;
 * measured on the AMD EPYC: 2-8 % at 9-36 rows, nothing at 1-6). */
static void pk_rows(int64_t M, int64_t K, const float *x, int64_t ldx, const float *wp, float *y, int64_t ldy,
                    const float *bias, int acc, int ncols) {
    const int64_t tiles = (M + 5) / 6;
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; ++t) {
        const int mr = (int)((M - m) / (tiles - t) + ((M - m) % (tiles - t) ? 1 : 0));
        const float *pfw = t == 0 ? wp + (tiles > 1 ? ss_lin_pf_wide : SS_PF_DIST) * SS_NB : wp + K * SS_NB;
        pk_tile_n(mr, K, x + m * ldx, ldx, wp, y + m * ldy, ldy, bias, acc, ncols, pfw);
        m += mr;
    }
}

/* ------------------------------------------------------------------ packed linear (AVX-512)
 * Where built with AVX-512 (and not switched off by ss_set_linear_avx512): MR (1..12) rows x two
 * panels, one 16-lane vector per (row, panel); each y[m, n] is still one FMA chain over k in order,
 * from zero, then the same store (bias, accumulate) as pk_store_row: bitwise the AVX2 tile's. */
#ifndef SS_P5_MR
#define SS_P5_MR 12
#endif
#if defined(__AVX512F__) && defined(__AVX512DQ__)
SS_INLINE void pk512_store(__m512 c, float *yr, const float *bias, int acc, int ncols) {
    if (ncols == SS_NB) {  /* (the loop below, by element, compiles to calls to memcpy) */
        if (bias) c = _mm512_add_ps(c, _mm512_loadu_ps(bias));
        if (acc) c = _mm512_add_ps(_mm512_loadu_ps(yr), c);
        _mm512_storeu_ps(yr, c);
        return;
    }
    float v[16];
    _mm512_storeu_ps(v, c);
    for (int u = 0; u < ncols; ++u) {
        float s = v[u];
        if (bias) s += bias[u];
        if (acc) yr[u] += s; else yr[u] = s;
    }
}

#define P5_ACC(i) __m512 c##i##0 = _mm512_setzero_ps(), c##i##1 = c##i##0;
#define P5_ROW(i)                                                       \
    if (MR > i) {                                                       \
        const __m512 xb = _mm512_set1_ps(x[i * ldx + k]);               \
        c##i##0 = _mm512_fmadd_ps(xb, w0, c##i##0);                     \
        if (NP > 1) c##i##1 = _mm512_fmadd_ps(xb, w1, c##i##1);         \
    }
#define P5_OUT(i)                                                                          \
    if (MR > i) {                                                                          \
        pk512_store(c##i##0, y + i * ldy, bias, acc, nc0);                                 \
        if (NP > 1) pk512_store(c##i##1, y + i * ldy + SS_NB, bias ? bias + SS_NB : NULL, acc, nc1); \
    }
/* y[MR, 16 NP] (=|+=) x[MR, K] . panels wp (and wp + panel); pfw: a stream prefetched line by line
 * (16 floats per k) and pfw2 a second one (NULL: none) */
SS_INLINE void pk512_tile(const int MR, const int NP, int64_t K, const float *x, int64_t ldx, const float *wp,
                          int64_t panel, float *y, int64_t ldy, const float *bias, int acc, int nc0, int nc1,
                          const float *pfw, const float *pfw2) {
    P5_ACC(0) P5_ACC(1) P5_ACC(2) P5_ACC(3) P5_ACC(4) P5_ACC(5) P5_ACC(6) P5_ACC(7) P5_ACC(8) P5_ACC(9)
    P5_ACC(10) P5_ACC(11)
    const float *wq = wp + panel;
    for (int64_t k = 0; k < K; ++k) {
        _mm_prefetch((const char *)(pfw + k * SS_NB), _MM_HINT_T0);
        if (pfw2) _mm_prefetch((const char *)(pfw2 + k * SS_NB), _MM_HINT_T0);
        __m512 w0 = _mm512_loadu_ps(wp + k * SS_NB);
        __m512 w1 = NP > 1 ? _mm512_loadu_ps(wq + k * SS_NB) : w0;
        /* in registers: GCC otherwise folds the loads into the FMAs, one 64-byte load per FMA (MR
         * per weight vector), which bound the tile at 2-4 rows (AMD EPYC, in L2: M = 4 at 156
         * GFLOP/s, 207 with this; M = 2 1.19x; M = 1, 8, 12 unchanged) */
        __asm__("" : "+v"(w0), "+v"(w1));
        P5_ROW(0) P5_ROW(1) P5_ROW(2) P5_ROW(3) P5_ROW(4) P5_ROW(5) P5_ROW(6) P5_ROW(7) P5_ROW(8) P5_ROW(9)
        P5_ROW(10) P5_ROW(11)
    }
    P5_OUT(0) P5_OUT(1) P5_OUT(2) P5_OUT(3) P5_OUT(4) P5_OUT(5) P5_OUT(6) P5_OUT(7) P5_OUT(8) P5_OUT(9)
    P5_OUT(10) P5_OUT(11)
}

/* one function per tile shape (inlined into one switch, GCC spills the accumulators) */
#define P5_FN(MR_, NP_)                                                                                    \
    static __attribute__((noinline)) void pk512_##MR_##_##NP_(int64_t K, const float *x, int64_t ldx,       \
            const float *wp, int64_t panel, float *y, int64_t ldy, const float *bias, int acc, int nc0,    \
            int nc1, const float *pfw, const float *pfw2) {                                                \
        pk512_tile(MR_, NP_, K, x, ldx, wp, panel, y, ldy, bias, acc, nc0, nc1, pfw, pfw2);                \
    }
#define P5_FNS(MR_) P5_FN(MR_, 1) P5_FN(MR_, 2)
P5_FNS(1) P5_FNS(2) P5_FNS(3) P5_FNS(4) P5_FNS(5) P5_FNS(6) P5_FNS(7) P5_FNS(8) P5_FNS(9) P5_FNS(10) P5_FNS(11)
P5_FNS(12)
#define P5_CASE(MR_)                                                                                       \
    case MR_:                                                                                              \
        if (np == 2) pk512_##MR_##_2(K, x, ldx, wp, panel, y, ldy, bias, acc, nc0, nc1, pfw, pfw2);         \
        else pk512_##MR_##_1(K, x, ldx, wp, panel, y, ldy, bias, acc, nc0, nc1, pfw, pfw2);                 \
        break;
SS_INLINE void pk512_tile_n(int mr, int np, int64_t K, const float *x, int64_t ldx, const float *wp, int64_t panel,
                            float *y, int64_t ldy, const float *bias, int acc, int nc0, int nc1, const float *pfw,
                            const float *pfw2) {
    switch (mr) {
        P5_CASE(12) P5_CASE(11) P5_CASE(10) P5_CASE(9) P5_CASE(8) P5_CASE(7) P5_CASE(6) P5_CASE(5) P5_CASE(4)
        P5_CASE(3) P5_CASE(2) default: P5_CASE(1)
    }
}

/* rows 0 .. M-1 against np (1, 2) panels in balanced tiles of at most 12 rows: the first tile
 * streams the panels (prefetching SS_PF_DIST rows ahead, ss_lin_pf_wide with two tiles or more),
 * later ones reuse them from cache and prefetch the next panels (nxt, NULL at the end) */
static void pk512_rows(int64_t M, int64_t K, const float *x, int64_t ldx, const float *wp, int64_t panel, int np,
                       float *y, int64_t ldy, const float *bias, int acc, int nc0, int nc1, const float *nxt) {
    const int64_t tiles = (M + SS_P5_MR - 1) / SS_P5_MR, ahead = (tiles > 1 ? ss_lin_pf_wide : SS_PF_DIST) * SS_NB;
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; ++t) {
        const int mr = (int)((M - m) / (tiles - t) + ((M - m) % (tiles - t) ? 1 : 0));
        const float *pfw = t == 0 ? wp + ahead : (nxt ? nxt : wp);
        const float *pfw2 = np > 1 ? (t == 0 ? wp + panel + ahead : (nxt ? nxt + panel : NULL)) : NULL;
        pk512_tile_n(mr, np, K, x + m * ldx, ldx, wp, panel, y + m * ldy, ldy, bias, acc, nc0, nc1, pfw, pfw2);
        m += mr;
    }
}
#define SS_LIN512 1
#else
#define SS_LIN512 0
#endif

/* 1 where this build has the AVX-512 linear tile and it is on (the default where built) */
static int ss_lin512 = SS_LIN512;

/* Switch the AVX-512 linear tile on (1) or off (0: the AVX2 tiles, the same results); returns what
 * is now in use. Call between kernels only. */
SS_API int ss_set_linear_avx512(int on) {
    ss_lin512 = on && SS_LIN512;
    return ss_lin512;
}

/* y[M, N] (=|+=) x[M, K] @ W^T (+ bias), W as packed panels (ss_pack_weight's layout). Threads take
 * contiguous ranges of panels; a panel is read from memory once and reused from cache for every
 * block of rows. */
/* The work-sharing body (an orphaned "omp for": called inside a parallel region, every thread
 * takes its share; the standalone ss_* entry points open the region). */
static void lin_packed_body(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const float *wp,
                            const float *bias, float *y, int64_t ldy, int acc) {
    const int64_t npanels = (N + SS_NB - 1) / SS_NB, panel = K * SS_NB;
    /* one or two rows: the AVX2 tiles' pairs of panels, unless the AVX-512 tile is on (then it takes
     * every M: measured on an AMD EPYC, SmolLM2-135M's linears at M = 2 ran at 46 GB/s in the
     * AVX2 pair tile and 65 GB/s in the AVX-512 one, M = 1 at 68 and 69; bitwise the same) */
    if (M <= 2 && !ss_lin512) {
        const int64_t npairs = (npanels + 1) / 2;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < npairs; ++t) {
            int64_t p = 2 * t, n0 = p * SS_NB;
            const float *bn = bias ? bias + n0 : NULL;
            if (p + 1 < npanels) {
                int nc2 = (int)(N - n0 - SS_NB < SS_NB ? N - n0 - SS_NB : SS_NB);
                if (M == 2) pk_tile2(2, K, x, ldx, wp + p * panel, panel, y + n0, ldy, bn, acc, nc2);
                else pk_tile2(1, K, x, ldx, wp + p * panel, panel, y + n0, ldy, bn, acc, nc2);
            } else {
                pk_rows(M, K, x, ldx, wp + p * panel, y + n0, ldy, bn, acc, (int)(N - n0));
            }
        }
        return;
    }
#if SS_LIN512
    if (ss_lin512) {  /* pairs of panels */
        const int64_t npairs = (npanels + 1) / 2;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < npairs; ++t) {
            const int64_t p = 2 * t, n0 = p * SS_NB;
            const int np = p + 1 < npanels ? 2 : 1;
            const int nc0 = (int)(N - n0 < SS_NB ? N - n0 : SS_NB);
            const int nc1 = np > 1 ? (int)(N - n0 - SS_NB < SS_NB ? N - n0 - SS_NB : SS_NB) : 0;
            const float *nxt = p + 2 < npanels ? wp + (p + 2) * panel : NULL;
            pk512_rows(M, K, x, ldx, wp + p * panel, panel, np, y + n0, ldy, bias ? bias + n0 : NULL, acc, nc0, nc1,
                       nxt);
        }
        return;
    }
#endif
#pragma omp for schedule(static)
    for (int64_t p = 0; p < npanels; ++p) {
        int64_t n0 = p * SS_NB;
        int nc = (int)(N - n0 < SS_NB ? N - n0 : SS_NB);
        pk_rows(M, K, x, ldx, wp + p * panel, y + n0, ldy, bias ? bias + n0 : NULL, acc, nc);
    }
}

SS_API void ss_linear_packed(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const float *wp,
                             const float *bias, float *y, int64_t ldy, int acc, int nthreads) {
#pragma omp parallel num_threads(ss_threads(nthreads))
    lin_packed_body(M, N, K, x, ldx, wp, bias, y, ldy, acc);
}

SS_API int64_t ss_pack_numel(int64_t N, int64_t K) { return ((N + SS_NB - 1) / SS_NB) * K * SS_NB; }

/* W [N, K] (row stride ldw) -> panels (ss_linear_packed's layout), zero-padded past N */
SS_API void ss_pack_weight(int64_t N, int64_t K, const float *w, int64_t ldw, float *wp, int nthreads) {
    const int64_t npanels = (N + SS_NB - 1) / SS_NB;
#pragma omp parallel for schedule(static) num_threads(ss_threads(nthreads))
    for (int64_t p = 0; p < npanels; ++p) {
        float *dst = wp + p * K * SS_NB;
        for (int64_t k = 0; k < K; ++k)
            for (int c = 0; c < SS_NB; ++c) {
                int64_t n = p * SS_NB + c;
                dst[k * SS_NB + c] = n < N ? w[n * ldw + k] : 0.0f;
            }
    }
}

/* ------------------------------------------------------------------ small fused ops */
/* y[m] = w * (x[m] * 1 / sqrt(mean(x[m]^2) + eps)); rows of E floats (E % 8 == 0 on the fast path). */
static void rms_body(int64_t M, int64_t E, const float *x, int64_t ldx, const float *w, float eps, float *y,
                     int64_t ldy) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
        const float *xr = x + m * ldx;
        float *yr = y + m * ldy;
        __m256 acc = _mm256_setzero_ps();
        int64_t e = 0;
        for (; e + 8 <= E; e += 8) {
            __m256 v = _mm256_loadu_ps(xr + e);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum8(acc);
        for (int64_t j = e; j < E; ++j) ss += xr[j] * xr[j];
        float inv = 1.0f / sqrtf(ss / (float)E + eps);
        __m256 vi = _mm256_set1_ps(inv);
        for (e = 0; e + 8 <= E; e += 8)
            _mm256_storeu_ps(yr + e, _mm256_mul_ps(_mm256_loadu_ps(w + e), _mm256_mul_ps(_mm256_loadu_ps(xr + e), vi)));
        for (int64_t j = e; j < E; ++j) yr[j] = w[j] * (xr[j] * inv);
    }
}

SS_API void ss_rms_norm(int64_t M, int64_t E, const float *x, int64_t ldx, const float *w, float eps, float *y,
                        int64_t ldy, int nthreads) {
#pragma omp parallel num_threads(ss_threads(nthreads)) if (M > 4)
    rms_body(M, E, x, ldx, w, eps, y, ldy);
}

/* gu [M, 2I] (gate | up) -> y [M, I] = silu(gate) * up, silu(g) = g / (1 + exp(-g)). */
/* (blocks of 64 columns, so even one row splits over the threads; the same ops per element) */
static void silu_body(int64_t M, int64_t I, const float *gu, int64_t ldg, float *y, int64_t ldy) {
    const int64_t nb = (I + 63) / 64;
#pragma omp for schedule(static)
    for (int64_t mb = 0; mb < M * nb; ++mb) {
        const int64_t m = mb / nb, i0 = (mb % nb) * 64, i1 = i0 + 64 < I ? i0 + 64 : I;
        const float *g = gu + m * ldg, *u = g + I;
        float *yr = y + m * ldy;
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        int64_t i = i0;
        for (; i + 8 <= i1; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
        for (; i < i1; ++i) yr[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
    }
}

SS_API void ss_silu_mul(int64_t M, int64_t I, const float *gu, int64_t ldg, float *y, int64_t ldy, int nthreads) {
#pragma omp parallel num_threads(ss_threads(nthreads)) if (M * I > 16384)
    silu_body(M, I, gu, ldg, y, ldy);
}

/* Rotary embedding of the q and k heads of qkv [B*T, (H + 2 H_kv) * D] (row stride ldq), with
 * cos/sin [B*T, D]: q -> q_out [B, H, T, D]; k -> k_out [B, H_kv, T, D]; v copied to v_out
 * [B, H_kv, T, D]. rot(x) = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1). */
/* The body also writes k and v where the attention will read them: k of token t of row b, KV
 * head kv, goes to k_dst + b * k_sb + kv * k_sh + (pos[b] + t) * D (pos NULL: 0), v likewise: the
 * dense cache at each row's length (decode, verify) or the draft's tail slot. */
static void rope_body(int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D, const float *qkv, int64_t ldq,
                      const float *cosv, const float *sinv, float *q_out, float *k_dst, int64_t k_sb, int64_t k_sh,
                      float *v_dst, int64_t v_sb, int64_t v_sh, const int64_t *pos) {
    const int64_t half = D / 2, nheads = H + 2 * Hkv;
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * T * nheads; ++bh) {
        const int64_t bt = bh / nheads, h = bh % nheads, b = bt / T, t = bt % T;
        const int64_t slot = (pos ? pos[b] : 0) + t;
        const float *c = cosv + bt * D, *s = sinv + bt * D;
        {
            const float *x = qkv + bt * ldq + h * D;
            float *dst;
            if (h < H) dst = q_out + ((b * H + h) * T + t) * D;
            else if (h < H + Hkv) dst = k_dst + b * k_sb + (h - H) * k_sh + slot * D;
            else {
                memcpy(v_dst + b * v_sb + (h - H - Hkv) * v_sh + slot * D, x, (size_t)D * sizeof(float));
                continue;
            }
            for (int64_t d = 0; d < half; ++d) {
                float a = x[d] * c[d], r = -x[d + half] * s[d];
                dst[d] = a + r;
            }
            for (int64_t d = half; d < D; ++d) {
                float a = x[d] * c[d], r = x[d - half] * s[d];
                dst[d] = a + r;
            }
        }
    }
}

SS_API void ss_rope_split(int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D, const float *qkv, int64_t ldq,
                          const float *cosv, const float *sinv, float *q_out, float *k_out, float *v_out,
                          int nthreads) {
#pragma omp parallel num_threads(ss_threads(nthreads)) if (B * T > 4)
    rope_body(B, T, H, Hkv, D, qkv, ldq, cosv, sinv, q_out, k_out, Hkv * T * D, T * D, v_out, Hkv * T * D, T * D,
              NULL);
}

/* ------------------------------------------------------------------ attention
 * One (b, kv) pair has R = G * T query rows and n keys. Keys are split in chunks of SS_CHUNK at
 * fixed offsets; a work item is one (b, kv, chunk) and does, while its scores are in cache:
 *   scores s[r, j] = (scale * q_r) . k_j (masked: -inf), the chunk's row max m_c, p = exp(s - m_c),
 *   l_c = sum p and the partial o_c = p . V (flash-decoding's split over keys).
 * Then per pair: M = max_c m_c, L = sum_c exp(m_c - M) l_c, out = sum_c exp(m_c - M) o_c / L, in
 * chunk order; and per chunk, the importance rows sum_g p exp(m_c - M) / L of the last W queries.
 * Dense mode: key j is cache position j; row r = g*T + t sees j <= start_b + t.
 * Sparse mode (the draft): key j < nv_b is cache position index[b, kv, j]; key nv_b + e is the
 * draft tail's slot e; row t sees every index key and tail slots e <= E - T + t.
 */
typedef struct {
    int64_t B, Hkv, G, T, D;
    const float *q;
    const float *k, *v;
    int64_t k_sb, k_sh, v_sb, v_sh;
    const int64_t *starts;       /* dense: [B] */
    const int32_t *index;        /* sparse: [B, H_kv, N] (strides i_sb, i_sh) */
    int64_t i_sb, i_sh;
    const int64_t *n_valid;      /* sparse: [B] */
    const float *kt, *vt;        /* sparse: draft tail, (b, kv, e, d) at b*t_sb + kv*t_sh + e*D + d */
    int64_t t_sb, t_sh, E;
    float *out;
    int64_t o_sb, o_st;
    float *rows;                 /* [B, H_kv, *, S_rows] (strides r_sb, r_sh, r_sw) or NULL */
    int64_t r_sb, r_sh, r_sw, W, S_rows;
    const int64_t *slots;        /* [B, W]: query w of row b goes to row slot slots[b, w] (NULL: slot w) */
    float scale;
    int sparse;
    float *ws;                   /* workspace (ss_attention_workspace floats) */
    int64_t n_max;               /* max keys of any row */
} attn_t;

SS_INLINE int64_t att_nkeys(const attn_t *a, int64_t b) {
    return a->sparse ? a->n_valid[b] + a->E : a->starts[b] + a->T;
}

SS_INLINE const float *att_key(const attn_t *a, int64_t b, int64_t kv, int64_t j, int64_t nv, const int32_t *idx) {
    if (!a->sparse) return a->k + b * a->k_sb + kv * a->k_sh + j * a->D;
    if (j < nv) return a->k + b * a->k_sb + kv * a->k_sh + (int64_t)idx[j] * a->D;
    return a->kt + b * a->t_sb + kv * a->t_sh + (j - nv) * a->D;
}

SS_INLINE const float *att_val(const attn_t *a, int64_t b, int64_t kv, int64_t j, int64_t nv, const int32_t *idx) {
    if (!a->sparse) return a->v + b * a->v_sb + kv * a->v_sh + j * a->D;
    if (j < nv) return a->v + b * a->v_sb + kv * a->v_sh + (int64_t)idx[j] * a->D;
    return a->vt + b * a->t_sb + kv * a->t_sh + (j - nv) * a->D;
}

/* last visible key of query t of row b (inclusive) */
SS_INLINE int64_t att_limit(const attn_t *a, int64_t b, int64_t t, int64_t nv) {
    return a->sparse ? nv + a->E - a->T + t : a->starts[b] + t;
}

SS_INLINE int64_t att_nchunks(const attn_t *a) { return (a->n_max + SS_CHUNK - 1) / SS_CHUNK; }
SS_INLINE int64_t att_chunks_of(const attn_t *a, int64_t b) { return (att_nkeys(a, b) + SS_CHUNK - 1) / SS_CHUNK; }

/* workspace (64-byte aligned where the caller's is): scores [pairs, R, n_max padded to 16]; per item (pair,
 * chunk): m [R], l [R] (padded to 16 floats), o [R, D], the AVX-512 tiles' query pairs [R + 1, D]
 * and in sparse mode room to gather the chunk's value rows [SS_CHUNK, D]; per pair: M [R], L [R].
 * o and the query pairs start on a cache line where D % 16 == 0 (their 64-byte loads and stores
 * split across two lines otherwise: a k = 2 verify's attention 1.17x slower in L2 and 1.10-1.14x
 * at 4 x 6K on the AMD EPYC of benchmarks/RESULTS.md, twenty-seventh session). */
SS_INLINE int64_t att_pad16(int64_t n) { return (n + 15) / 16 * 16; }

/* the scores' row stride: n_max rounded up to a cache line */
SS_INLINE int64_t att_ld(const attn_t *a) { return att_pad16(a->n_max); }

SS_INLINE float *att_scores(const attn_t *a, int64_t b, int64_t kv) {
    return a->ws + ((b * a->Hkv + kv) * a->G * a->T) * att_ld(a);
}

/* floats per item */
SS_INLINE int64_t att_item_size(int64_t R, int64_t D, int sparse) {
    return att_pad16(2 * R) + R * D + (R + 1) * D + (sparse ? SS_CHUNK * D : 0);
}

/* where an item's o [R, D] starts (after m and l) */
SS_INLINE int64_t att_item_o(int64_t R) { return att_pad16(2 * R); }

SS_INLINE float *att_item(const attn_t *a, int64_t b, int64_t kv, int64_t c) {
    const int64_t R = a->G * a->T, per = att_item_size(R, a->D, a->sparse);
    float *base = a->ws + a->B * a->Hkv * R * att_ld(a);
    return base + ((b * a->Hkv + kv) * att_nchunks(a) + c) * per;
}

SS_INLINE float *att_pair(const attn_t *a, int64_t b, int64_t kv) {
    const int64_t R = a->G * a->T;
    float *base = a->ws + a->B * a->Hkv * R * att_ld(a) +
                  a->B * a->Hkv * att_nchunks(a) * att_item_size(R, a->D, a->sparse);
    return base + (b * a->Hkv + kv) * 2 * R;
}

/* 3 rows x 32 columns of P.V over kn keys (value rows ldv apart): 3 broadcasts + 1 value vector +
 * 12 accumulators per key, the same chain per element as gemm_tile */
SS_INLINE void att_pv3x32(const attn_t *a, const float *P, int64_t ldp, int64_t kn, const float *v, int64_t ldv,
                          float *part, int64_t ldpart) {
    (void)a;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;
    __m256 c20 = c00, c21 = c00, c22 = c00, c23 = c00;
    for (int64_t j = 0; j < kn; ++j) {
        const float *vp = v + j * ldv;
        __m256 p0 = _mm256_broadcast_ss(P + j), p1 = _mm256_broadcast_ss(P + ldp + j), p2 = _mm256_broadcast_ss(P + 2 * ldp + j);
        __m256 vv = _mm256_loadu_ps(vp);
        c00 = _mm256_fmadd_ps(p0, vv, c00); c10 = _mm256_fmadd_ps(p1, vv, c10); c20 = _mm256_fmadd_ps(p2, vv, c20);
        vv = _mm256_loadu_ps(vp + 8);
        c01 = _mm256_fmadd_ps(p0, vv, c01); c11 = _mm256_fmadd_ps(p1, vv, c11); c21 = _mm256_fmadd_ps(p2, vv, c21);
        vv = _mm256_loadu_ps(vp + 16);
        c02 = _mm256_fmadd_ps(p0, vv, c02); c12 = _mm256_fmadd_ps(p1, vv, c12); c22 = _mm256_fmadd_ps(p2, vv, c22);
        vv = _mm256_loadu_ps(vp + 24);
        c03 = _mm256_fmadd_ps(p0, vv, c03); c13 = _mm256_fmadd_ps(p1, vv, c13); c23 = _mm256_fmadd_ps(p2, vv, c23);
    }
    _mm256_storeu_ps(part, c00); _mm256_storeu_ps(part + 8, c01); _mm256_storeu_ps(part + 16, c02); _mm256_storeu_ps(part + 24, c03);
    part += ldpart;
    _mm256_storeu_ps(part, c10); _mm256_storeu_ps(part + 8, c11); _mm256_storeu_ps(part + 16, c12); _mm256_storeu_ps(part + 24, c13);
    part += ldpart;
    _mm256_storeu_ps(part, c20); _mm256_storeu_ps(part + 8, c21); _mm256_storeu_ps(part + 16, c22); _mm256_storeu_ps(part + 24, c23);
}

/* ------------------------------------------------------------------ attention, AVX-512 tiles
 * Where the library is built for AVX-512 (and ss_set_attention_avx512 has not switched them off),
 * the attention runs the same operations as above in 16 lanes, so every score, sum and output
 * stays bitwise equal to the AVX2 path's (and a verify to the AR steps):
 *   - scores of two query rows at once: a vector holds row r's 8 chain lanes in its low half and
 *     row r + 1's in its high half (the scaled queries rearranged once per item, q2), against a
 *     key's 8 values broadcast into both halves (a plain load); 4 keys x up to 4 row pairs per tile,
 *     reduced with hsum8's tree by shuffles (hadd512 = hadd);
 *   - the chunk's exp in 16 lanes (exp16 = exp8 per lane), its sums still 8 lanes in key order;
 *   - o_c = P.V: 6 rows x 64 columns per tile, one FMA chain per element over the keys in order. */
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define SS_HAVE512 1

/* exp8's operations in 16 lanes (bitwise the same per lane) */
SS_INLINE __m512 exp16(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-87.33654475f);
    __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(x, hi);
    x = _mm512_max_ps(x, lo);
    __m512 fx = _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f));
    fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(0.693359375f)));
    x = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 z = _mm512_mul_ps(x, x);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, z, x);
    y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
    __m512i n = _mm512_cvttps_epi32(fx);
    n = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(n));
    return _mm512_maskz_mov_ps((__mmask16)~under, y);
}

/* _mm256_hadd_ps's sums in each 128-bit lane: [a0+a1, a2+a3, b0+b1, b2+b3] */
SS_INLINE __m512 hadd512(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

/* A0..A3: rows (r, r+1) x keys 0..3, A4..A7: rows (r+2, r+3) x keys 0..3 -> 128-bit lane i holds
 * row r + i's four scores, each hsum8's tree of its 8 chain lanes */
SS_INLINE __m512 hsum16x8(__m512 a0, __m512 a1, __m512 a2, __m512 a3, __m512 a4, __m512 a5, __m512 a6,
                          __m512 a7) {
    __m512 u0 = hadd512(hadd512(a0, a1), hadd512(a2, a3)), u1 = hadd512(hadd512(a4, a5), hadd512(a6, a7));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
}

SS_INLINE void sc512_store(__m512 s, int rows, float *S, int64_t ld, int64_t j, int nk) {
    if (nk == 4) {
        _mm_storeu_ps(S + j, _mm512_castps512_ps128(s));
        if (rows > 1) _mm_storeu_ps(S + ld + j, _mm512_extractf32x4_ps(s, 1));
        if (rows > 2) _mm_storeu_ps(S + 2 * ld + j, _mm512_extractf32x4_ps(s, 2));
        if (rows > 3) _mm_storeu_ps(S + 3 * ld + j, _mm512_extractf32x4_ps(s, 3));
        return;
    }
    float sv[16];
    _mm512_storeu_ps(sv, s);
    for (int i = 0; i < rows; ++i)
        for (int u = 0; u < nk; ++u) S[i * ld + j + u] = sv[4 * i + u];
}

#define S5_ACC(p) __m512 a##p##0 = _mm512_setzero_ps(), a##p##1 = a##p##0, a##p##2 = a##p##0, a##p##3 = a##p##0;
#define S5_ROW(p)                                                                     \
    if (NP > p) {                                                                     \
        __m512 x = _mm512_loadu_ps(q2 + (p) * 2 * D + 2 * d);                         \
        __asm__("" : "+v"(x));                                                        \
        a##p##0 = _mm512_fmadd_ps(x, k0, a##p##0);                                    \
        a##p##1 = _mm512_fmadd_ps(x, k1, a##p##1);                                    \
        a##p##2 = _mm512_fmadd_ps(x, k2, a##p##2);                                    \
        a##p##3 = _mm512_fmadd_ps(x, k3, a##p##3);                                    \
    }
/* scores of rows r .. r + vr - 1 (vr <= 2 NP; NP row pairs: 1, 2, 4 or 5, the last pair's second row
 * zeros where vr is odd) x keys kp[0..3] (nk valid) into S (rows ld apart, column j); q2: the
 * pairs' queries, pair p's d-block [d, d+8) of both rows at q2 + p * 2D + 2d (row r + 2p in the low
 * half). Nine or ten rows (a k = 2 verify over 3 query heads per KV head) run as one tile of five
 * pairs: an odd ninth row in a tile call of its own (or the AVX2 rows) cost 1.12x the attention. */
SS_INLINE void sc512_tile(const int NP, const float *q2, const float *const *kp, int nk, const int64_t D, float *S,
                          int64_t ld, int64_t j, int vr) {
    S5_ACC(0) S5_ACC(1) S5_ACC(2) S5_ACC(3) S5_ACC(4)
    /* not unrolled, the pairs' queries in registers (GCC otherwise unrolls the D = 64 loop and
     * folds every query load into its four FMAs): in L2 on the AMD EPYC, 6 rows 1.11x, 7 (Qwen's
     * decode) 1.08x, 15-51 rows 1.06-1.07x, 9 rows (k = 2 over 3 heads) unchanged */
#pragma GCC unroll 1
    for (int64_t d = 0; d < D; d += 8) {
        const __m512 k0 = _mm512_broadcast_f32x8(_mm256_loadu_ps(kp[0] + d));
        const __m512 k1 = _mm512_broadcast_f32x8(_mm256_loadu_ps(kp[1] + d));
        const __m512 k2 = _mm512_broadcast_f32x8(_mm256_loadu_ps(kp[2] + d));
        const __m512 k3 = _mm512_broadcast_f32x8(_mm256_loadu_ps(kp[3] + d));
        S5_ROW(0) S5_ROW(1) S5_ROW(2) S5_ROW(3) S5_ROW(4)
    }
    if (NP == 1) sc512_store(hsum16x8(a00, a01, a02, a03, a00, a01, a02, a03), vr, S, ld, j, nk);
    if (NP >= 2) sc512_store(hsum16x8(a00, a01, a02, a03, a10, a11, a12, a13), vr < 4 ? vr : 4, S, ld, j, nk);
    if (NP >= 4)
        sc512_store(hsum16x8(a20, a21, a22, a23, a30, a31, a32, a33), vr < 8 ? vr - 4 : 4, S + 4 * ld, ld, j, nk);
    if (NP == 5) sc512_store(hsum16x8(a40, a41, a42, a43, a40, a41, a42, a43), vr - 8, S + 8 * ld, ld, j, nk);
}

/* q2 of rows [0, R2) (R2 = R rounded up to even; a padding row zeros) from the scaled queries qs [R, D] */
SS_INLINE void sc512_pack_pairs(const float *qs, int64_t R, int64_t R2, const int64_t D, float *q2) {
    for (int64_t p = 0; p < R2 / 2; ++p)
        for (int64_t d = 0; d < D; d += 8) {
            _mm256_storeu_ps(q2 + p * 2 * D + 2 * d, _mm256_loadu_ps(qs + 2 * p * D + d));
            const __m256 odd = 2 * p + 1 < R ? _mm256_loadu_ps(qs + (2 * p + 1) * D + d) : _mm256_setzero_ps();
            _mm256_storeu_ps(q2 + p * 2 * D + 2 * d + 8, odd);
        }
}

/* MR (1..6) rows x NV (1..4) vectors of 16 columns of o = P.V over kn keys (p[r, j] at P[r * pr + j * pj],
 * value rows ldv apart; or, with vp, key j's value columns at vp[j]: the draft's indexed rows
 * read where they lie): gemm_tile's chains in 16 lanes, from 0; with alpha (the prefill's online
 * softmax), o = alpha[r] * o + P.V instead */
#define PV_ACC(i)                                                                     \
    __m512 c##i##0 = _mm512_setzero_ps(), c##i##1 = c##i##0, c##i##2 = c##i##0, c##i##3 = c##i##0; \
    if (alpha && MR > i) {                                                            \
        const __m512 al = _mm512_set1_ps(alpha[i]);                                   \
        const float *o = out + (i) * ldo;                                             \
        if (NV > 0) c##i##0 = _mm512_mul_ps(al, _mm512_loadu_ps(o));                  \
        if (NV > 1) c##i##1 = _mm512_mul_ps(al, _mm512_loadu_ps(o + 16));             \
        if (NV > 2) c##i##2 = _mm512_mul_ps(al, _mm512_loadu_ps(o + 32));             \
        if (NV > 3) c##i##3 = _mm512_mul_ps(al, _mm512_loadu_ps(o + 48));             \
    }
#define PV_ROW(i)                                                                     \
    if (MR > i) {                                                                     \
        const __m512 pb = _mm512_set1_ps(P[(i) * pr + j * pj]);                       \
        if (NV > 0) c##i##0 = _mm512_fmadd_ps(pb, v0, c##i##0);                       \
        if (NV > 1) c##i##1 = _mm512_fmadd_ps(pb, v1, c##i##1);                       \
        if (NV > 2) c##i##2 = _mm512_fmadd_ps(pb, v2, c##i##2);                       \
        if (NV > 3) c##i##3 = _mm512_fmadd_ps(pb, v3, c##i##3);                       \
    }
#define PV_OUT(i)                                                                     \
    if (MR > i) {                                                                     \
        float *o = out + i * ldo;                                                     \
        if (NV > 0) _mm512_storeu_ps(o, c##i##0);                                     \
        if (NV > 1) _mm512_storeu_ps(o + 16, c##i##1);                                \
        if (NV > 2) _mm512_storeu_ps(o + 32, c##i##2);                                \
        if (NV > 3) _mm512_storeu_ps(o + 48, c##i##3);                                \
    }
/* pf > 0: fetch value row j + pf (its NV x 64 bytes) into L1 while key j's products run (a decode
 * or verify chunk's first row tile: ss_pv_pf) */
SS_INLINE void pv512_tile_g(const int MR, const int NV, int64_t kn, const float *P, int64_t pr, int64_t pj,
                            const float *v, int64_t ldv, const float *const *vp, float *out, int64_t ldo,
                            const float *alpha, int64_t pf, const char *nk, int64_t nk_row, int64_t nkn) {
    PV_ACC(0) PV_ACC(1) PV_ACC(2) PV_ACC(3) PV_ACC(4) PV_ACC(5)
    for (int64_t j = 0; j < kn; ++j) {
        const float *vj = vp ? vp[j] : v + j * ldv;
        if (pf && j + pf < kn) {
            const char *vn = (const char *)(vp ? vp[j + pf] : vj + pf * ldv);
            for (int o = 0; o < NV * 64; o += 64) _mm_prefetch(vn + o, _MM_HINT_T0);
        }
        if (nk && j < nkn)  /* the next chunk's key row j into L2 (the memory is idle in P.V) */
            for (int64_t o = 0; o < nk_row; o += 64) _mm_prefetch(nk + j * nk_row + o, _MM_HINT_T1);
        const __m512 v0 = _mm512_loadu_ps(vj);
        const __m512 v1 = NV > 1 ? _mm512_loadu_ps(vj + 16) : v0;
        const __m512 v2 = NV > 2 ? _mm512_loadu_ps(vj + 32) : v0;
        const __m512 v3 = NV > 3 ? _mm512_loadu_ps(vj + 48) : v0;
        PV_ROW(0) PV_ROW(1) PV_ROW(2) PV_ROW(3) PV_ROW(4) PV_ROW(5)
    }
    PV_OUT(0) PV_OUT(1) PV_OUT(2) PV_OUT(3) PV_OUT(4) PV_OUT(5)
}

SS_INLINE void pv512_tile(const int MR, const int NV, int64_t kn, const float *P, int64_t ldp, const float *v,
                          int64_t ldv, const float *const *vp, float *out, int64_t ldo, int64_t pf, const char *nk,
                          int64_t nk_row, int64_t nkn) {
    pv512_tile_g(MR, NV, kn, P, ldp, 1, v, ldv, vp, out, ldo, NULL, pf, nk, nk_row, nkn);
}

#define PV_TILE(MR_, NV_) pv512_tile(MR_, NV_, kn, Pr, ldp, vd, ldv, vp ? vpd : NULL, o, ldo, r ? 0 : pf, nkr, nk_row, nkn)
#define PV_CASE(MR_)                                                                  \
    case MR_:                                                                         \
        switch (NV) {                                                                 \
            case 4: PV_TILE(MR_, 4); break;                                           \
            case 3: PV_TILE(MR_, 3); break;                                           \
            case 2: PV_TILE(MR_, 2); break;                                           \
            default: PV_TILE(MR_, 1); break;                                          \
        }                                                                             \
        break;
/* o [R, D] (rows ldo apart) = P [R, kn] . V [kn, D], D % 16 == 0; value row j at v + j * ldv, or
 * with vp (kn <= SS_CHUNK) at vp[j] */
static void pv512_rows(int64_t R, int64_t kn, const float *P, int64_t ldp, const float *v, int64_t ldv,
                       const float *const *vp, int64_t D, float *out, int64_t ldo, int64_t pf, const char *nk,
                       int64_t nk_row, int64_t nkn) {
    const float *vpd[vp ? SS_CHUNK : 1];
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int NV = (int)((D - d0) / 16 < 4 ? (D - d0) / 16 : 4);
        if (vp)
            for (int64_t j = 0; j < kn; ++j) vpd[j] = vp[j] + d0;
        for (int64_t r = 0; r < R; r += 6) {
            const int MR = (int)(R - r < 6 ? R - r : 6);
            const float *Pr = P + r * ldp, *vd = vp ? NULL : v + d0;
            const char *nkr = r || d0 ? NULL : nk;  /* the next keys: fetched in the first tile only */
            float *o = out + r * ldo + d0;
            switch (MR) { PV_CASE(6) PV_CASE(5) PV_CASE(4) PV_CASE(3) PV_CASE(2) PV_CASE(1) }
        }
    }
}

/* Keys-in-lanes score tiles (a wide verify's rows): the same products and sums as sc512_tile /
 * hsum8x8, so the same bits, without horizontal reductions. A block of up to 32 keys is transposed
 * once (kt[d * 32 + u] = key u's element d); a score vector then holds 16 keys of one row. Chain
 * lane i of every score (the FMA chain over d = i, i + 8, ..., from 0) runs for up to 12 rows x 32
 * keys at once, 24 accumulators fed by broadcast(q[d]) * kt[d] as in a GEMM tile; the 8 chain sums
 * are then added as hsum8's tree ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)) with vertical adds.
 * Measured on the AMD EPYC of benchmarks/RESULTS.md (one core, keys in cache): 229 GFLOP/s for the
 * tiles against 109 for sc512_tile's; the transpose costs 86 ns per block, so they pay only where
 * enough rows share a block (ss_set_attention_kt: chosen at load by the kernel plan's trial). */

/* kt [D, 32] from the keys kp[0..nk) (nk <= 32; missing keys read as key 0, their scores unused) */
SS_INLINE void kt32_transpose(const float *const *kp, int nk, const int64_t D, float *kt) {
    for (int h = 0; h < 2; ++h) {
        const float *rp[16];
        for (int u = 0; u < 16; ++u) rp[u] = kp[16 * h + u < nk ? 16 * h + u : 0];
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m512 r0 = _mm512_loadu_ps(rp[0] + d0), r1 = _mm512_loadu_ps(rp[1] + d0), r2 = _mm512_loadu_ps(rp[2] + d0),
                   r3 = _mm512_loadu_ps(rp[3] + d0), r4 = _mm512_loadu_ps(rp[4] + d0), r5 = _mm512_loadu_ps(rp[5] + d0),
                   r6 = _mm512_loadu_ps(rp[6] + d0), r7 = _mm512_loadu_ps(rp[7] + d0), r8 = _mm512_loadu_ps(rp[8] + d0),
                   r9 = _mm512_loadu_ps(rp[9] + d0), r10 = _mm512_loadu_ps(rp[10] + d0), r11 = _mm512_loadu_ps(rp[11] + d0),
                   r12 = _mm512_loadu_ps(rp[12] + d0), r13 = _mm512_loadu_ps(rp[13] + d0),
                   r14 = _mm512_loadu_ps(rp[14] + d0), r15 = _mm512_loadu_ps(rp[15] + d0);
            __m512 t0 = _mm512_unpacklo_ps(r0, r1), t1 = _mm512_unpackhi_ps(r0, r1), t2 = _mm512_unpacklo_ps(r2, r3),
                   t3 = _mm512_unpackhi_ps(r2, r3), t4 = _mm512_unpacklo_ps(r4, r5), t5 = _mm512_unpackhi_ps(r4, r5),
                   t6 = _mm512_unpacklo_ps(r6, r7), t7 = _mm512_unpackhi_ps(r6, r7), t8 = _mm512_unpacklo_ps(r8, r9),
                   t9 = _mm512_unpackhi_ps(r8, r9), t10 = _mm512_unpacklo_ps(r10, r11), t11 = _mm512_unpackhi_ps(r10, r11),
                   t12 = _mm512_unpacklo_ps(r12, r13), t13 = _mm512_unpackhi_ps(r12, r13),
                   t14 = _mm512_unpacklo_ps(r14, r15), t15 = _mm512_unpackhi_ps(r14, r15);
            r0 = _mm512_shuffle_ps(t0, t2, 0x44); r1 = _mm512_shuffle_ps(t0, t2, 0xEE);
            r2 = _mm512_shuffle_ps(t1, t3, 0x44); r3 = _mm512_shuffle_ps(t1, t3, 0xEE);
            r4 = _mm512_shuffle_ps(t4, t6, 0x44); r5 = _mm512_shuffle_ps(t4, t6, 0xEE);
            r6 = _mm512_shuffle_ps(t5, t7, 0x44); r7 = _mm512_shuffle_ps(t5, t7, 0xEE);
            r8 = _mm512_shuffle_ps(t8, t10, 0x44); r9 = _mm512_shuffle_ps(t8, t10, 0xEE);
            r10 = _mm512_shuffle_ps(t9, t11, 0x44); r11 = _mm512_shuffle_ps(t9, t11, 0xEE);
            r12 = _mm512_shuffle_ps(t12, t14, 0x44); r13 = _mm512_shuffle_ps(t12, t14, 0xEE);
            r14 = _mm512_shuffle_ps(t13, t15, 0x44); r15 = _mm512_shuffle_ps(t13, t15, 0xEE);
            t0 = _mm512_shuffle_f32x4(r0, r4, 0x88); t1 = _mm512_shuffle_f32x4(r1, r5, 0x88);
            t2 = _mm512_shuffle_f32x4(r2, r6, 0x88); t3 = _mm512_shuffle_f32x4(r3, r7, 0x88);
            t4 = _mm512_shuffle_f32x4(r0, r4, 0xDD); t5 = _mm512_shuffle_f32x4(r1, r5, 0xDD);
            t6 = _mm512_shuffle_f32x4(r2, r6, 0xDD); t7 = _mm512_shuffle_f32x4(r3, r7, 0xDD);
            t8 = _mm512_shuffle_f32x4(r8, r12, 0x88); t9 = _mm512_shuffle_f32x4(r9, r13, 0x88);
            t10 = _mm512_shuffle_f32x4(r10, r14, 0x88); t11 = _mm512_shuffle_f32x4(r11, r15, 0x88);
            t12 = _mm512_shuffle_f32x4(r8, r12, 0xDD); t13 = _mm512_shuffle_f32x4(r9, r13, 0xDD);
            t14 = _mm512_shuffle_f32x4(r10, r14, 0xDD); t15 = _mm512_shuffle_f32x4(r11, r15, 0xDD);
            float *o = kt + d0 * 32 + 16 * h;
            _mm512_storeu_ps(o + 0 * 32, _mm512_shuffle_f32x4(t0, t8, 0x88));
            _mm512_storeu_ps(o + 1 * 32, _mm512_shuffle_f32x4(t1, t9, 0x88));
            _mm512_storeu_ps(o + 2 * 32, _mm512_shuffle_f32x4(t2, t10, 0x88));
            _mm512_storeu_ps(o + 3 * 32, _mm512_shuffle_f32x4(t3, t11, 0x88));
            _mm512_storeu_ps(o + 4 * 32, _mm512_shuffle_f32x4(t4, t12, 0x88));
            _mm512_storeu_ps(o + 5 * 32, _mm512_shuffle_f32x4(t5, t13, 0x88));
            _mm512_storeu_ps(o + 6 * 32, _mm512_shuffle_f32x4(t6, t14, 0x88));
            _mm512_storeu_ps(o + 7 * 32, _mm512_shuffle_f32x4(t7, t15, 0x88));
            _mm512_storeu_ps(o + 8 * 32, _mm512_shuffle_f32x4(t0, t8, 0xDD));
            _mm512_storeu_ps(o + 9 * 32, _mm512_shuffle_f32x4(t1, t9, 0xDD));
            _mm512_storeu_ps(o + 10 * 32, _mm512_shuffle_f32x4(t2, t10, 0xDD));
            _mm512_storeu_ps(o + 11 * 32, _mm512_shuffle_f32x4(t3, t11, 0xDD));
            _mm512_storeu_ps(o + 12 * 32, _mm512_shuffle_f32x4(t4, t12, 0xDD));
            _mm512_storeu_ps(o + 13 * 32, _mm512_shuffle_f32x4(t5, t13, 0xDD));
            _mm512_storeu_ps(o + 14 * 32, _mm512_shuffle_f32x4(t6, t14, 0xDD));
            _mm512_storeu_ps(o + 15 * 32, _mm512_shuffle_f32x4(t7, t15, 0xDD));
        }
    }
}

#define KT_RB 12
#define KT_ACC(r) __m512 c##r##0 = _mm512_setzero_ps(), c##r##1 = c##r##0;
#define KT_FMA(r)                                                                     \
    if (RB > r) {                                                                     \
        const __m512 x = _mm512_set1_ps(q[(r) * D + d]);                              \
        c##r##0 = _mm512_fmadd_ps(x, k0, c##r##0);                                    \
        if (KB > 1) c##r##1 = _mm512_fmadd_ps(x, k1, c##r##1);                        \
    }
#define KT_OUT(r)                                                                     \
    if (RB > r) {                                                                     \
        _mm512_store_ps(sp + ((i * KT_RB + (r)) * 2) * 16, c##r##0);                  \
        if (KB > 1) _mm512_store_ps(sp + ((i * KT_RB + (r)) * 2 + 1) * 16, c##r##1);  \
    }
/* scores of RB (1..12) rows (scaled queries q, rows D apart) x nk (<= 16 KB) keys of kt into S
 * (rows ld apart, columns j ..): chain lane i (d = i, i + 8, ...) of every (row, key) at a time,
 * RB x KB accumulators as in a GEMM tile, then hsum8's tree over the 8 chain sums */
SS_INLINE void kt_tile(const int RB, const int KB, const float *q, const float *kt, int nk, const int64_t D,
                       float *S, int64_t ld, int64_t j) {
    float sp[8 * KT_RB * 2 * 16] __attribute__((aligned(64)));
    for (int i = 0; i < 8; ++i) {
        KT_ACC(0) KT_ACC(1) KT_ACC(2) KT_ACC(3) KT_ACC(4) KT_ACC(5)
        KT_ACC(6) KT_ACC(7) KT_ACC(8) KT_ACC(9) KT_ACC(10) KT_ACC(11)
        for (int64_t d = i; d < D; d += 8) {
            const __m512 k0 = _mm512_loadu_ps(kt + d * 32), k1 = KB > 1 ? _mm512_loadu_ps(kt + d * 32 + 16) : k0;
            KT_FMA(0) KT_FMA(1) KT_FMA(2) KT_FMA(3) KT_FMA(4) KT_FMA(5)
            KT_FMA(6) KT_FMA(7) KT_FMA(8) KT_FMA(9) KT_FMA(10) KT_FMA(11)
        }
        KT_OUT(0) KT_OUT(1) KT_OUT(2) KT_OUT(3) KT_OUT(4) KT_OUT(5)
        KT_OUT(6) KT_OUT(7) KT_OUT(8) KT_OUT(9) KT_OUT(10) KT_OUT(11)
    }
    const __mmask16 m0 = (__mmask16)(nk >= 16 ? 0xFFFF : (1u << nk) - 1);
    const __mmask16 m1 = (__mmask16)(nk >= 32 ? 0xFFFF : nk <= 16 ? 0 : (1u << (nk - 16)) - 1);
    for (int r = 0; r < RB; ++r)
        for (int h = 0; h < KB; ++h) {  /* ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)) */
            const float *l = sp + (r * 2 + h) * 16;
            const int64_t st = KT_RB * 32;
#define KT_L(c) _mm512_load_ps(l + (c) * st)
            const __m512 v = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(KT_L(0), KT_L(1)), _mm512_add_ps(KT_L(2), KT_L(3))),
                                           _mm512_add_ps(_mm512_add_ps(KT_L(4), KT_L(5)), _mm512_add_ps(KT_L(6), KT_L(7))));
#undef KT_L
            _mm512_mask_storeu_ps(S + r * ld + j + 16 * h, h ? m1 : m0, v);
        }
}

#define KT_CASE(n) case n: kt_tile(n, 2, q, kt, nk, D, S, ld, j); break;
/* scores of h (1..12) rows from q x the nk keys of kt into S (rows ld apart, column j) */
SS_INLINE void kt_group(int64_t h, const float *q, const float *kt, int nk, const int64_t D, float *S, int64_t ld,
                        int64_t j) {
    switch (h) { KT_CASE(12) KT_CASE(11) KT_CASE(10) KT_CASE(9) KT_CASE(8) KT_CASE(7) KT_CASE(6) KT_CASE(5)
                 KT_CASE(4) KT_CASE(3) KT_CASE(2) default: KT_CASE(1) }
}
#else
#define SS_HAVE512 0
#endif

/* 1 where this build has the AVX-512 tiles and they are on (the default where built) */
static int ss_att512 = SS_HAVE512;
/* the fewest query rows of a (b, kv) pair whose scores run in the keys-in-lanes tiles (kt_tile;
 * with the AVX-512 tiles on; the same results either way); 0: none */
static int ss_att_kt = 0;
/* 1: the keys-in-lanes path fetches each block's value rows into L2 while it computes the block's
 * scores; 0: it leaves them to the P.V phase (the hardware prefetcher). Measured at load by the
 * kernel plan: on the AMD EPYC of benchmarks/RESULTS.md the early fetch made a batch 8 x 8K
 * verify's attention 11-13 % slower (the fetches compete with the block's key reads). */
static int ss_kt_vpf = 1;

/* > 0: the dense attention's P.V (decode and verify; the AVX-512 tiles) fetches the value row this
 * many keys ahead into L1 as it goes (in a chunk's first row tile); 0: it leaves them to the hardware
 * prefetcher. Measured at load by the kernel plan (the same results either way): on the AMD EPYC
 * of benchmarks/RESULTS.md (twenty-fifth session, alternated in one process) 16 keys ahead made
 * the attention at batch 1-8 x 2-8K 1-8 % faster at T = 1 and 3-9 % at T = 3, and changed little
 * at T = 9. */
static int64_t ss_pv_pf = 16;

/* 1: the dense attention's P.V (the AVX-512 tiles) also fetches the next item's key rows into L2
 * (the next chunk's, or the next (b, kv) pair's first chunk), one row per value row it reads: the
 * memory, otherwise idle while a chunk's softmax and products run, brings the keys the next score
 * loop reads; 0: the score loop's own fetches only. It runs where the score loop's own fetches
 * reach least far: a one-token forward (decode) and the keys-in-lanes tiles (which fetch the next
 * 32 keys only). Measured at load by the kernel plan (the same results either way): on the AMD
 * EPYC of benchmarks/RESULTS.md (twenty-sixth session, alternated in one process, 30 layers'
 * caches) the decode attention ran 4-8 % faster at batch 1 x 4K to 8 x 8K and a k = 8 verify's
 * in keys-in-lanes tiles 10 % at 4 x 6K; with the row-pair score tiles of a verify it runs up to
 * the width ss_nk_vt (below). */
static int ss_nk_pf = 1;

/* > 0: the same fetch also in a verify of up to this many query positions (T) in the row-pair
 * score tiles; 0: not there. Measured at load by the kernel plan's fetch trial at T = 3 (k = 2):
 * on the AMD EPYC of benchmarks/RESULTS.md (twenty-seventh session, one layer's attention at 4 x 6K
 * alternated in one process, ten pairs) it made a k = 2 verify's attention 1.08x faster (median;
 * 0.95-1.32) once that attention's own arithmetic got faster, and a k = 8 verify's (T = 9, row-pair
 * tiles) 0.93x: wider verifies keep without it. */
static int64_t ss_nk_vt = 3;

/* Switch the decode's fetch of the next item's keys on (1) or off (0); returns the setting. */
SS_API int ss_set_attention_next_kprefetch(int on) {
    ss_nk_pf = on != 0;
    return ss_nk_pf;
}

/* Set the widest verify (query positions, 0: none; at most SS_CHUNK) in the row-pair tiles whose P.V
 * also fetches the next item's keys (with ss_set_attention_next_kprefetch on); returns the setting. */
SS_API int ss_set_attention_verify_kprefetch(int max_t) {
    ss_nk_vt = max_t < 0 ? 0 : max_t > SS_CHUNK ? SS_CHUNK : max_t;
    return (int)ss_nk_vt;
}

/* Set how many keys ahead the dense P.V fetches value rows (0: none; at most SS_CHUNK); returns the
 * setting. */
SS_API int ss_set_attention_pv_prefetch(int keys_ahead) {
    ss_pv_pf = keys_ahead < 0 ? 0 : keys_ahead > SS_CHUNK ? SS_CHUNK : keys_ahead;
    return (int)ss_pv_pf;
}

/* > 0: a one-token forward's score loop (decode, the sparse draft; T = 1) also fetches the keys this
 * many positions ahead into L2; 0: only the near ones into L1 (SS_KPF_DIST). Measured at load by the
 * kernel plan (the same results either way): on the AMD EPYC of benchmarks/RESULTS.md (twenty-fifth
 * session) 32 keys ahead made the decode attention 8-15 % faster at batch 1-8 x 2-8K; at T = 3 the
 * same fetch was 3-7 % slower, so it runs at T = 1 only. */
static int64_t ss_dk_pf = 32;

/* Set how many keys ahead a one-token forward's score loop fetches keys into L2 (0: none; at most
 * SS_CHUNK); returns the setting. */
SS_API int ss_set_attention_decode_kprefetch(int keys_ahead) {
    ss_dk_pf = keys_ahead < 0 ? 0 : keys_ahead > SS_CHUNK ? SS_CHUNK : keys_ahead;
    return (int)ss_dk_pf;
}

/* Switch the keys-in-lanes path's early fetch of value rows on (1) or off (0); returns the setting
 * (the results are the same either way). */
SS_API int ss_set_attention_kt_vprefetch(int on) {
    ss_kt_vpf = on != 0;
    return ss_kt_vpf;
}

/* Set the fewest rows for the keys-in-lanes score tiles (0: off); returns what is now in use (0
 * where the library was built without AVX-512). The kernel plan measures it at load: the tiles
 * transpose 32 keys once per block, which pays only when enough rows share it. */
SS_API int ss_set_attention_kt(int min_rows) {
    ss_att_kt = SS_HAVE512 && min_rows > 0 ? min_rows : 0;
    return ss_att_kt;
}

/* Switch the AVX-512 attention tiles on (1) or off (0: the AVX2 tiles, the same results); returns
 * what is now in use (0 where the library was built without AVX-512). Call between kernels only. */
SS_API int ss_set_attention_avx512(int on) {
    ss_att512 = on && SS_HAVE512;
    return ss_att512;
}

/* The chunk softmax numerators of rows 0 .. NR-1 (NR 1..4, rows ld apart) over keys [j0, j1): m_c
 * (mx), p = exp(s - m_c) in place, l_c (sums). p = 0 where masked; a row that sees none of the chunk
 * gets m_c = -inf, p = l_c = 0. Each row's l_c is 8 lanes summed over j = u mod 8 in key order, then
 * hsum8; the rows are interleaved so that their add chains overlap (the same operations per row). */
SS_INLINE void att_softmax_rows(const int NR, float *S, int64_t ld, int64_t j0, int64_t j1, float *mx, float *sums) {
    __m256 acc[4], mv[4];
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) {
        const float *row = S + i * ld;
        __m256 ma = _mm256_set1_ps(-INFINITY), mb = ma;  /* max is exact: any grouping */
        int64_t j = j0;
        for (; j + 16 <= j1; j += 16) {
            ma = _mm256_max_ps(ma, _mm256_loadu_ps(row + j));
            mb = _mm256_max_ps(mb, _mm256_loadu_ps(row + j + 8));
        }
        for (; j + 8 <= j1; j += 8) ma = _mm256_max_ps(ma, _mm256_loadu_ps(row + j));
        ma = _mm256_max_ps(ma, mb);
        float m8v[8], mm = -INFINITY;
        _mm256_storeu_ps(m8v, ma);
        for (int u = 0; u < 8; ++u) mm = m8v[u] > mm ? m8v[u] : mm;
        for (; j < j1; ++j) mm = row[j] > mm ? row[j] : mm;
        mx[i] = mm;
        mv[i] = _mm256_set1_ps(mm == -INFINITY ? 0.0f : mm);
        acc[i] = _mm256_setzero_ps();
    }
    int64_t j = j0;
#if SS_HAVE512
    if (ss_att512) {  /* 16 at a time; the sums still 8 lanes, in the same order */
        for (; j + 16 <= j1; j += 16) {
#pragma GCC unroll 4
            for (int i = 0; i < NR; ++i) {
                float *row = S + i * ld;
                __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), _mm512_broadcast_f32x8(mv[i])));
                _mm512_storeu_ps(row + j, p);
                acc[i] = _mm256_add_ps(acc[i], _mm512_castps512_ps256(p));
                acc[i] = _mm256_add_ps(acc[i], _mm512_extractf32x8_ps(p, 1));
            }
        }
    }
#endif
    for (; j + 8 <= j1; j += 8) {
#pragma GCC unroll 4
        for (int i = 0; i < NR; ++i) {
            float *row = S + i * ld;
            __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), mv[i]));
            _mm256_storeu_ps(row + j, p);
            acc[i] = _mm256_add_ps(acc[i], p);
        }
    }
    if (j < j1) {  /* partial vector: pad with -inf (probability 0) */
#pragma GCC unroll 4
        for (int i = 0; i < NR; ++i) {
            float *row = S + i * ld, buf[8];
            for (int u = 0; u < 8; ++u) buf[u] = (j + u < j1) ? row[j + u] : -INFINITY;
            __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(buf), mv[i]));
            _mm256_storeu_ps(buf, p);
            for (int u = 0; j + u < j1; ++u) row[j + u] = buf[u];
            acc[i] = _mm256_add_ps(acc[i], p);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) sums[i] = hsum8(acc[i]);
}

/* One item: scores, chunk softmax and P.V partial of keys [j0, j1) for every row of (b, kv); D is
 * a->D, passed so that att_chunk can inline it with a constant head size (the d-loops unrolled). */
SS_INLINE void att_chunk_d(const attn_t *a, int64_t b, int64_t kv, int64_t c, const int64_t D) {
    const int64_t R = a->G * a->T, T = a->T;
    const int64_t n = att_nkeys(a, b), j0 = c * SS_CHUNK, j1 = (j0 + SS_CHUNK < n) ? j0 + SS_CHUNK : n;
    const int64_t nv = a->sparse ? a->n_valid[b] : 0;
    const int32_t *idx = a->sparse ? a->index + b * a->i_sb + kv * a->i_sh : NULL;
    const float *q = a->q + ((b * a->Hkv + kv) * R) * D;
    float *S = att_scores(a, b, kv);
    float *it = att_item(a, b, kv, c);
    float *mx = it, *sums = it + R, *part = it + att_item_o(R);
    const int64_t ld = att_ld(a);
    const int64_t dk = T == 1 ? ss_dk_pf : 0;  /* a one-token forward's keys fetched far ahead into L2 */
    float *qs = part;  /* q * scale, in the partials' room until P.V overwrites it (after the scores) */
    for (int64_t i = 0; i < R * D; ++i) qs[i] = q[i] * a->scale;
#if SS_HAVE512
    /* every row in the AVX-512 tiles (pairs of rows; an odd count's last row padded), from 4 rows up
     * (a decode step's G = 3 rows stay on the AVX2 tiles: 1.27x slower in the row-pair tiles, in L2,
     * measured before the workspace was aligned) */
    const int use_kt = ss_att512 && ss_att_kt && R >= ss_att_kt && D % 16 == 0;
    const int64_t R5 = (ss_att512 && !use_kt && R >= SS_R512_MIN) ? (R + 1) / 2 * 2 : 0;
    float *q2 = part + R * D + (a->sparse ? SS_CHUNK * D : 0);
    if (R5) sc512_pack_pairs(qs, R, R5, D, q2);
#endif
    /* 1. scores: dot products, 2 rows x 4 keys per block (8 FMA chains over d in 8 lanes, then
     *    hsum8x8's tree), q pre-scaled */
#if SS_HAVE512
    if (use_kt) {
        /* keys-in-lanes tiles: 32 keys transposed once, then every row (the same bits as below) */
        float kt[32 * D] __attribute__((aligned(64)));
        for (int64_t j = j0; j < j1; j += 32) {
            const float *kp[32];
            const int nk = (int)(j1 - j < 32 ? j1 - j : 32);
            for (int u = 0; u < nk; ++u) kp[u] = att_key(a, b, kv, j + u, nv, idx);
            kt32_transpose(kp, nk, D, kt);
            /* the tiles, with this block's value rows (into L2, for P.V) and the next block's keys
             * (into L1) fetched a share before each tile: the reads spread over the compute */
            const int64_t groups = (R + KT_RB - 1) / KT_RB;
            for (int64_t g = 0, r = 0; g < groups; ++g) {
                for (int64_t u = g * 32 / groups; u < (g + 1) * 32 / groups; ++u) {
                    if (u < nk && ss_kt_vpf) {
                        const char *vp = (const char *)att_val(a, b, kv, j + u, nv, idx);
                        for (int64_t o = 0; o < D * 4; o += SS_VPF_STEP) _mm_prefetch(vp + o, _MM_HINT_T1);
                    }
                    if (j + 32 + u < n) {
                        const char *kq = (const char *)att_key(a, b, kv, j + 32 + u, nv, idx);
                        for (int64_t o = 0; o < D * 4; o += 64) _mm_prefetch(kq + o, _MM_HINT_T0);
                    }
                }
                const int64_t h = (R - r) / (groups - g) + ((R - r) % (groups - g) != 0);
                kt_group(h, qs + r * D, kt, nk, D, S + r * ld, ld, j);
                r += h;
            }
            if (j + nk - 1 > att_limit(a, b, 0, nv))  /* the causal tail */
                for (int64_t rr = 0; rr < R; ++rr) {
                    const int64_t lim = att_limit(a, b, rr % T, nv);
                    for (int u = 0; u < nk; ++u)
                        if (j + u > lim) S[rr * ld + j + u] = -INFINITY;
                }
        }
    } else
#endif
    for (int64_t j = j0; j < j1; j += 4) {
        const float *kp[4];
        const int nk = (int)(j1 - j < 4 ? j1 - j : 4);
        for (int u = 0; u < 4; ++u) kp[u] = att_key(a, b, kv, u < nk ? j + u : j, nv, idx);
        /* the value rows P.V reads after the softmax, fetched into L2 now (a chunk's are 64 KB at
         * D = 64): read there in key order 16 columns at a time, they would stall on memory (measured
         * on the AMD EPYC, B = 4 x 6K: -19 % at T = 1, -25 % at T = 3, -12 % at T = 9) */
        for (int u = 0; u < nk; ++u) {
            const char *vp = (const char *)att_val(a, b, kv, j + u, nv, idx);
            for (int64_t o = 0; o < D * 4; o += SS_VPF_STEP) _mm_prefetch(vp + o, _MM_HINT_T1);
        }
        for (int u = 0; u < 4 * (dk > 0); ++u)
            if (j + dk + u < n) {
                const char *kq = (const char *)att_key(a, b, kv, j + dk + u, nv, idx);
                for (int64_t o = 0; o < D * 4; o += 64) _mm_prefetch(kq + o, _MM_HINT_T1);
            }
        for (int u = 0; u < 4 * (SS_KPF_DIST > 0); ++u)  /* keys ahead into L1 (measured: 5-10 % at T = 1-9) */
            if (j + SS_KPF_DIST + u < n) {
                const char *kq = (const char *)att_key(a, b, kv, j + SS_KPF_DIST + u, nv, idx);
                for (int64_t o = 0; o < D * 4; o += SS_KPF_STEP) _mm_prefetch(kq + o, _MM_HINT_T0);
            }
        int64_t r = 0;
#if SS_HAVE512
        if (R5 == 10) {
            sc512_tile(5, q2, kp, nk, D, S, ld, j, (int)R);
            r = R5;
        }
#define SC512_ROWS(NP_) (int)(R - r < 2 * (NP_) ? R - r : 2 * (NP_))
        for (; r + 8 <= R5; r += 8) sc512_tile(4, q2 + r * D, kp, nk, D, S + r * ld, ld, j, SC512_ROWS(4));
        for (; r + 4 <= R5; r += 4) sc512_tile(2, q2 + r * D, kp, nk, D, S + r * ld, ld, j, SC512_ROWS(2));
        for (; r + 2 <= R5; r += 2) sc512_tile(1, q2 + r * D, kp, nk, D, S + r * ld, ld, j, SC512_ROWS(1));
#undef SC512_ROWS
        if (r > R) r = R;
#endif
        for (; r + 2 <= R; r += 2) {
            const float *q0 = qs + r * D, *q1 = q0 + D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t d = 0; d < D; d += 8) {
                __m256 x0 = _mm256_loadu_ps(q0 + d), x1 = _mm256_loadu_ps(q1 + d);
                __m256 k0 = _mm256_loadu_ps(kp[0] + d), k1 = _mm256_loadu_ps(kp[1] + d);
                __m256 k2 = _mm256_loadu_ps(kp[2] + d), k3 = _mm256_loadu_ps(kp[3] + d);
                __asm__("" : "+x"(x0), "+x"(x1), "+x"(k0), "+x"(k1), "+x"(k2), "+x"(k3));  /* (pk512_tile) */
                a0 = _mm256_fmadd_ps(x0, k0, a0); a1 = _mm256_fmadd_ps(x0, k1, a1);
                a2 = _mm256_fmadd_ps(x0, k2, a2); a3 = _mm256_fmadd_ps(x0, k3, a3);
                a4 = _mm256_fmadd_ps(x1, k0, a4); a5 = _mm256_fmadd_ps(x1, k1, a5);
                a6 = _mm256_fmadd_ps(x1, k2, a6); a7 = _mm256_fmadd_ps(x1, k3, a7);
            }
            __m256 s8 = hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7);
            if (nk == 4) {
                _mm_storeu_ps(S + r * ld + j, _mm256_castps256_ps128(s8));
                _mm_storeu_ps(S + (r + 1) * ld + j, _mm256_extractf128_ps(s8, 1));
            } else {
                float sv[8];
                _mm256_storeu_ps(sv, s8);
                for (int u = 0; u < nk; ++u) { S[r * ld + j + u] = sv[u]; S[(r + 1) * ld + j + u] = sv[4 + u]; }
            }
        }
        for (; r < R; ++r) {
            const float *q0 = qs + r * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < D; d += 8) {
                __m256 x0 = _mm256_loadu_ps(q0 + d);
                __asm__("" : "+x"(x0));  /* in a register, not reloaded by each FMA: a decode 1.08x in L2 */
                a0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(kp[0] + d), a0);
                a1 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(kp[1] + d), a1);
                a2 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(kp[2] + d), a2);
                a3 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(kp[3] + d), a3);
            }
            const __m256 s8 = hsum8x8(a0, a1, a2, a3, a0, a1, a2, a3);
            if (nk == 4) {  /* (the store loop below compiles to a call to memcpy: 1.14x a decode's time) */
                _mm_storeu_ps(S + r * ld + j, _mm256_castps256_ps128(s8));
            } else {
                float sv[8];
                _mm256_storeu_ps(sv, s8);
                for (int u = 0; u < nk; ++u) S[r * ld + j + u] = sv[u];
            }
        }
        if (j + nk - 1 > att_limit(a, b, 0, nv))  /* the causal tail */
            for (int64_t rr = 0; rr < R; ++rr) {
                const int64_t lim = att_limit(a, b, rr % T, nv);
                for (int u = 0; u < nk; ++u)
                    if (j + u > lim) S[rr * ld + j + u] = -INFINITY;
            }
    }
    /* 2. the chunk's softmax numerators: m_c, p = exp(s - m_c) in place, l_c (p = 0 where masked; a
     *    row that sees none of the chunk gets m_c = -inf, p = l_c = 0) */
    for (int64_t r = 0; r < R; r += 4)
        switch (R - r < 4 ? R - r : 4) {
            case 4: att_softmax_rows(4, S + r * ld, ld, j0, j1, mx + r, sums + r); break;
            case 3: att_softmax_rows(3, S + r * ld, ld, j0, j1, mx + r, sums + r); break;
            case 2: att_softmax_rows(2, S + r * ld, ld, j0, j1, mx + r, sums + r); break;
            default: att_softmax_rows(1, S + r * ld, ld, j0, j1, mx + r, sums + r); break;
        }
    /* 3. o_c = P.V: for every (row, column) one FMA chain over the chunk's keys in order, whatever
     *    the block computing it: 6 rows x 16 columns (the GEMM tile), or 3 rows x 32 columns for a
     *    remainder of 3 rows (a decode step's G = 3 rows: half the broadcasts) */
    const float *vrows = att_val(a, b, kv, j0, nv, idx);
    const int64_t kn = j1 - j0;
#if SS_HAVE512
    if (ss_att512) {  /* the draft's value rows read where they lie (index positions, then the tail) */
        const float *vp[a->sparse ? SS_CHUNK : 1];
        if (a->sparse)
            for (int64_t u = 0; u < kn; ++u) vp[u] = att_val(a, b, kv, j0 + u, nv, idx);
        const char *nk = NULL;  /* the next item's keys (the next chunk, or the next pair's first) */
        int64_t nkn = 0;
        const int64_t p2 = b * a->Hkv + kv + (j1 >= n);  /* this pair's next chunk or the next pair's */
        if (!a->sparse && ss_nk_pf && (T == 1 || use_kt || T <= ss_nk_vt) && p2 < a->B * a->Hkv) {
            const int64_t b2 = p2 / a->Hkv, j2 = j1 < n ? j1 : 0, left = att_nkeys(a, b2) - j2;
            nk = (const char *)att_key(a, b2, p2 % a->Hkv, j2, 0, NULL);
            nkn = left < SS_CHUNK ? left : SS_CHUNK;
        }
        pv512_rows(R, kn, S + j0, ld, vrows, D, a->sparse ? vp : NULL, D, part, D, a->sparse ? 0 : ss_pv_pf,
                   nk, D * 4, nkn);
        return;
    }
#endif
    if (a->sparse) {  /* gather the chunk's value rows (index positions, then the draft tail) */
        float *vt = part + R * D;  /* the item's gather room (sparse mode only) */
        for (int64_t u = 0; u < kn; ++u) memcpy(vt + u * D, att_val(a, b, kv, j0 + u, nv, idx), (size_t)D * 4);
        vrows = vt;
    }
    const int wide3 = R % 6 == 3 && D % 32 == 0;
    const int64_t R6 = wide3 ? R - 3 : R;
    for (int64_t d0 = 0; d0 < D; d0 += SS_NB)
        gemm_rows(R6, kn, S + j0, ld, vrows + d0, D, part + d0, D, 0, SS_NB);
    if (wide3)
        for (int64_t d0 = 0; d0 < D; d0 += 32)
            att_pv3x32(a, S + R6 * ld + j0, ld, kn, vrows + d0, D, part + R6 * D + d0, D);
}

/* the same operations in the same order for every D; D = 64 (SmolLM2, Qwen2.5) as a constant */
static void att_chunk(const attn_t *a, int64_t b, int64_t kv, int64_t c) {
    if (a->D == 64) att_chunk_d(a, b, kv, c, 64);
    else att_chunk_d(a, b, kv, c, a->D);
}

/* per pair: M and L of every row, then the output rows */
static void att_combine(const attn_t *a, int64_t b, int64_t kv) {
    const int64_t R = a->G * a->T, D = a->D, T = a->T, nc = att_chunks_of(a, b);
    float *pr = att_pair(a, b, kv), *Mr = pr, *Lr = pr + R;
    float f[nc];  /* exp(m_c - M) of one row */
    for (int64_t r = 0; r < R; ++r) {
        float m = -INFINITY;
        for (int64_t c = 0; c < nc; ++c) {
            float v = att_item(a, b, kv, c)[r];
            m = v > m ? v : m;
        }
        float l = 0.0f;
        for (int64_t c = 0; c < nc; ++c) {
            const float *it = att_item(a, b, kv, c);
            f[c] = exp1(it[r] - m);
            l += f[c] * it[R + r];
        }
        Mr[r] = m;
        Lr[r] = l;
        const int64_t g = r / T, t = r % T;
        float *o = a->out + b * a->o_sb + t * a->o_st + (kv * a->G + g) * D;
        const __m256 inv = _mm256_set1_ps(l);
        for (int64_t d = 0; d < D; d += 8) {
            __m256 s = _mm256_setzero_ps();
            for (int64_t c = 0; c < nc; ++c)
                s = _mm256_fmadd_ps(_mm256_set1_ps(f[c]),
                                    _mm256_loadu_ps(att_item(a, b, kv, c) + att_item_o(R) + r * D + d), s);
            _mm256_storeu_ps(o + d, _mm256_div_ps(s, inv));
        }
    }
}

/* per item: importance rows of chunk c, rows[w, j] = sum_g p[g, T - W + w, j] exp(m_c - M) / L */
static void att_rows(const attn_t *a, int64_t b, int64_t kv, int64_t c) {
    const int64_t R = a->G * a->T, T = a->T, W = a->W;
    const int64_t n = att_nkeys(a, b), nc = att_chunks_of(a, b);
    const int64_t j0 = c * SS_CHUNK;
    int64_t j1 = j0 + SS_CHUNK;
    if (c == nc - 1 || j1 > a->S_rows) j1 = a->S_rows;  /* the last chunk also zero-fills to S_rows */
    const int64_t jv = n < j1 ? n : j1;
    const float *S = att_scores(a, b, kv), *it = att_item(a, b, kv, c), *pr = att_pair(a, b, kv);
    for (int64_t w = 0; w < W; ++w) {
        const int64_t t = T - W + w;
        const int64_t slot = a->slots ? a->slots[b * W + w] : w;
        float *dst = a->rows + b * a->r_sb + kv * a->r_sh + slot * a->r_sw;
        for (int64_t g = 0; g < a->G; ++g) {
            const int64_t r = g * T + t;
            const float f = exp1(it[r] - pr[r]) / pr[R + r];
            const float *p = S + r * att_ld(a);
            if (g == 0)
                for (int64_t j = j0; j < jv; ++j) dst[j] = p[j] * f;
            else
                for (int64_t j = j0; j < jv; ++j) dst[j] += p[j] * f;
        }
        for (int64_t j = jv; j < j1; ++j) dst[j] = 0.0f;
    }
}

SS_API int64_t ss_attention_workspace(int64_t B, int64_t Hkv, int64_t G, int64_t T, int64_t D, int64_t n_max,
                                      int sparse) {
    const int64_t R = G * T, nc = (n_max + SS_CHUNK - 1) / SS_CHUNK;
    return B * Hkv * R * att_pad16(n_max) + B * Hkv * nc * att_item_size(R, D, sparse) + B * Hkv * 2 * R;
}

static void att_body(const attn_t *a) {
    const int64_t B = a->B, Hkv = a->Hkv, nc = att_nchunks(a);
    const int64_t pairs = B * Hkv, items = pairs * nc;
    const int want_rows = a->rows != NULL && a->W > 0;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < items; ++i) {
        const int64_t p = i / nc, c = i % nc, b = p / Hkv, kv = p % Hkv;
        if (c < att_chunks_of(a, b)) att_chunk(a, b, kv, c);
    }
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; ++p) att_combine(a, p / Hkv, p % Hkv);
    if (want_rows) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < items; ++i) {
            const int64_t p = i / nc, c = i % nc, b = p / Hkv, kv = p % Hkv;
            if (c < att_chunks_of(a, b)) att_rows(a, b, kv, c);
        }
    }
}

static void att_run(attn_t *a, int nthreads) {
#pragma omp parallel num_threads(ss_threads(nthreads))
    att_body(a);
}

/* Dense causal attention of a ragged batch (decode T = 1, verify T = k + 1), optional importance
 * rows of the last W queries (rows == NULL: none), written to row slots[b, w] of the rows buffer
 * (an importance window's ring: no copy afterwards), [0, S_rows) of each, zero past the row's keys. Needs D % 16 == 0. */
SS_API void ss_attention(int64_t B, int64_t Hkv, int64_t G, int64_t T, int64_t D, const float *q, const float *k,
                         int64_t k_sb, int64_t k_sh, const float *v, int64_t v_sb, int64_t v_sh,
                         const int64_t *starts, float scale, float *out, int64_t o_sb, int64_t o_st, float *rows,
                         int64_t r_sb, int64_t r_sh, int64_t r_sw, int64_t W, int64_t S_rows,
                         const int64_t *slots, float *ws, int64_t n_max, int nthreads) {
    attn_t a;
    memset(&a, 0, sizeof a);
    a.B = B; a.Hkv = Hkv; a.G = G; a.T = T; a.D = D; a.q = q;
    a.k = k; a.k_sb = k_sb; a.k_sh = k_sh; a.v = v; a.v_sb = v_sb; a.v_sh = v_sh;
    a.starts = starts; a.scale = scale; a.out = out; a.o_sb = o_sb; a.o_st = o_st;
    a.rows = rows; a.r_sb = r_sb; a.r_sh = r_sh; a.r_sw = r_sw; a.W = W; a.S_rows = S_rows; a.slots = slots;
    a.ws = ws; a.n_max = n_max; a.sparse = 0;
    att_run(&a, nthreads);
}

/* ------------------------------------------------------------------ prefill attention (flash)
 * A prefill chunk's causal attention: T new queries per row (hundreds) at positions starts[b] ..
 * starts[b] + T - 1 over keys [0, starts[b] + T). One item is one KV group's query rows for up to
 * PF_ROWS / G positions (row r = (t - t0) * G + g), and it runs flash attention over blocks of
 * PF_NK keys with the rows in lanes: the scaled queries are transposed once per item, the scores
 * of 8 keys x 48 rows run in GEMM tiles (broadcast key element x 16 rows), the online softmax (m,
 * exp, l, the rescale alpha) runs down the keys in vertical operations 16 rows at a time, and P.V
 * in 6-row x 64-column tiles accumulates into the item's output rows. Rows whose position precedes
 * a block see none of it and skip it (the causal diagonal costs half). Each output row is a fixed
 * sequence of operations on its own inputs (any thread, any batch), but not a decode step's: a
 * prompt's prefill is shared by every method, so nothing compares it bitwise with a step.
 * Measured on the AMD EPYC of benchmarks/RESULTS.md (2 threads, a 512-query chunk after 7.7K keys,
 * SmolLM2's heads): 445 GFLOP/s, 2.3x PyTorch's flash attention (an earlier version with the keys
 * in lanes and a per-row softmax spent a third of its time in the softmax's horizontal reductions:
 * 330). Where the library has no AVX-512 (or ss_set_attention_avx512 switched its tiles off) the
 * same algorithm runs in AVX2 tiles, 8 rows per vector (pf8_*: scores of 4 keys x 24 rows, P.V in
 * 6-row x 16-column tiles), with the same operations per element in the same order: the same bits
 * as the AVX-512 tiles. On the AMD EPYC without AVX-512 (Zen 3) of benchmarks/RESULTS.md, the same
 * chunk: 127 GFLOP/s on 2 threads against PyTorch's 101 (1 thread: 66 against 59, of a measured FMA
 * peak of 93 a core); there the scores run at ~85 GFLOP/s a core, P.V at ~81 and the softmax takes a
 * sixth of the time. */
#define PF_NK 32
#ifndef PF_ROWS
#define PF_ROWS 192  /* query rows per item (G x positions): the Q, O and P rows stay in L2 */
#endif

typedef struct {
    int64_t B, Hkv, G, T, D;
    const float *q, *k, *v;
    int64_t k_sb, k_sh, v_sb, v_sh;
    const int64_t *starts;
    float scale;
    float *out;
    int64_t o_sb, o_st;
} pf_t;

/* floats of one thread's scratch for items of up to R rows */
SS_INLINE int64_t pf_scratch_floats(int64_t R, int64_t D) {
    const int64_t R16 = (R + 15) / 16 * 16;
    return D * R16 + PF_NK * R16 + R * D + 4 * R16 + 8 * D + 64;
}

/* One item's scratch (rows of KV head kv of batch row b at positions [t0, t1); ld = R rounded up
 * to 16, for either tile width) and its start: the scaled queries transposed, m = -inf, l = 0,
 * each row's last visible key (padding rows: never masked, never output), O = 0 */
typedef struct {
    int64_t R, ld, start, n;
    float *qT;    /* [D, ld]: the scaled queries transposed (64-byte aligned) */
    float *ST;    /* [PF_NK, ld]: scores, then probabilities */
    float *m, *l, *alpha;
    int32_t *lim; /* [ld]: each row's last visible key */
    float *O;     /* [R, D] */
    float *kbuf;  /* [8, D]: a partial group of keys */
    const float *kb, *vb;
} pf_item_t;

SS_INLINE pf_item_t pf_item_start(const pf_t *a, int64_t b, int64_t kv, int64_t t0, int64_t t1, float *scratch,
                                  const int64_t D) {
    const int64_t G = a->G, T = a->T;
    pf_item_t it;
    it.R = G * (t1 - t0);
    it.ld = (it.R + 15) / 16 * 16;
    it.start = a->starts[b];
    it.n = it.start + t1;
    it.qT = scratch;
    it.ST = it.qT + D * it.ld;
    it.m = it.ST + PF_NK * it.ld;
    it.l = it.m + it.ld;
    it.alpha = it.l + it.ld;
    it.lim = (int32_t *)(it.alpha + it.ld);
    it.O = it.alpha + 2 * it.ld;
    it.kbuf = it.O + it.R * D;
    for (int64_t r = 0; r < it.ld; ++r) {
        const int64_t t = t0 + r / G, g = r % G;
        const float *src = a->q + (((b * a->Hkv + kv) * G + g) * T + t) * D;
        for (int64_t d = 0; d < D; ++d) it.qT[d * it.ld + r] = r < it.R ? src[d] * a->scale : 0.0f;
        it.m[r] = -INFINITY;
        it.l[r] = 0.0f;
        it.lim[r] = r < it.R ? (int32_t)(it.start + t) : INT32_MAX;
    }
    memset(it.O, 0, (size_t)(it.R * D) * sizeof(float));
    it.kb = a->k + b * a->k_sb + kv * a->k_sh;
    it.vb = a->v + b * a->v_sb + kv * a->v_sh;
    return it;
}

/* the item's output rows: O / l (8 lanes at a time: the same products at either tile width) */
SS_INLINE void pf_item_finish(const pf_t *a, const pf_item_t *it, int64_t b, int64_t kv, int64_t t0, const int64_t D) {
    for (int64_t r = 0; r < it->R; ++r) {
        const int64_t t = t0 + r / a->G, g = r % a->G;
        float *o = a->out + b * a->o_sb + t * a->o_st + (kv * a->G + g) * D;
        const __m256 inv = _mm256_set1_ps(1.0f / it->l[r]);
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(it->O + r * D + d), inv));
    }
}

#if SS_HAVE512

#define PS_ACC(u) __m512 c##u##0 = _mm512_setzero_ps(), c##u##1 = c##u##0, c##u##2 = c##u##0;
#define PS_FMA(u)                                                                     \
    {                                                                                 \
        const __m512 x = _mm512_set1_ps(k[(u) * D + d]);                              \
        c##u##0 = _mm512_fmadd_ps(x, q0, c##u##0);                                    \
        if (NR > 1) c##u##1 = _mm512_fmadd_ps(x, q1, c##u##1);                        \
        if (NR > 2) c##u##2 = _mm512_fmadd_ps(x, q2, c##u##2);                        \
    }
#define PS_OUT(u)                                                                     \
    {                                                                                 \
        _mm512_store_ps(ST + (u) * ld, c##u##0);                                      \
        if (NR > 1) _mm512_store_ps(ST + (u) * ld + 16, c##u##1);                     \
        if (NR > 2) _mm512_store_ps(ST + (u) * ld + 32, c##u##2);                     \
    }
/* transposed scores of 8 keys (rows D apart from k) x NR (1..3) vectors of 16 query rows (the
 * scaled queries transposed, qT[d * ld + r]) into ST[u * ld + r] (64-byte aligned): 24
 * accumulators, broadcast(k[u, d]) x qT[d] as in a GEMM tile */
SS_INLINE void pf_scores(const int NR, const float *qT, const float *k, const int64_t D, float *ST, int64_t ld) {
    PS_ACC(0) PS_ACC(1) PS_ACC(2) PS_ACC(3) PS_ACC(4) PS_ACC(5) PS_ACC(6) PS_ACC(7)
    for (int64_t d = 0; d < D; ++d) {
        const __m512 q0 = _mm512_load_ps(qT + d * ld);
        const __m512 q1 = NR > 1 ? _mm512_load_ps(qT + d * ld + 16) : q0;
        const __m512 q2 = NR > 2 ? _mm512_load_ps(qT + d * ld + 32) : q0;
        PS_FMA(0) PS_FMA(1) PS_FMA(2) PS_FMA(3) PS_FMA(4) PS_FMA(5) PS_FMA(6) PS_FMA(7)
    }
    PS_OUT(0) PS_OUT(1) PS_OUT(2) PS_OUT(3) PS_OUT(4) PS_OUT(5) PS_OUT(6) PS_OUT(7)
}

/* o = alpha * o + P.V over a block of the prefill (p of row i, key j at P[j * ld + i]) */
#define PO_CASE(MR_)                                                                  \
    case MR_:                                                                         \
        switch (NV) {                                                                 \
            case 4: pv512_tile_g(MR_, 4, nk, Pr, 1, ld, vd, D, NULL, Or, D, al, 0, NULL, 0, 0); break; \
            case 3: pv512_tile_g(MR_, 3, nk, Pr, 1, ld, vd, D, NULL, Or, D, al, 0, NULL, 0, 0); break; \
            case 2: pv512_tile_g(MR_, 2, nk, Pr, 1, ld, vd, D, NULL, Or, D, al, 0, NULL, 0, 0); break; \
            default: pv512_tile_g(MR_, 1, nk, Pr, 1, ld, vd, D, NULL, Or, D, al, 0, NULL, 0, 0); break; \
        }                                                                             \
        break;

/* item: rows of KV head kv of batch row b at positions [t0, t1); the scores and probabilities
 * with the rows in lanes (ST[j, r]): the softmax's max, exp and sums then run down the keys in
 * vertical operations, 16 rows at a time */
SS_INLINE void pf_item_d(const pf_t *a, int64_t b, int64_t kv, int64_t t0, int64_t t1, float *scratch,
                         const int64_t D) {
    const pf_item_t it = pf_item_start(a, b, kv, t0, t1, scratch, D);
    const int64_t G = a->G, R = it.R, start = it.start, n = it.n, ld = it.ld, nv16 = ld / 16;
    float *qT = it.qT, *ST = it.ST, *m = it.m, *l = it.l, *alpha = it.alpha, *O = it.O, *kbuf = it.kbuf;
    const int32_t *lim = it.lim;
    const float *kb = it.kb, *vb = it.vb;
    for (int64_t j0 = 0; j0 < n; j0 += PF_NK) {
        const int nk = (int)(n - j0 < PF_NK ? n - j0 : PF_NK);
        /* rows of positions before the block see none of it: the active rows are [ra, R) */
        const int64_t tmin = j0 - start;
        const int64_t ra = tmin > t0 ? (tmin - t0) * G : 0, va = ra / 16;
        /* 1. scores, 8 keys x 48 rows per tile (a partial group repeats key j0; those keys and the
         *    missing groups are masked below) */
        for (int64_t u = 0; u < PF_NK; u += 8) {
            if (u >= nk) break;  /* the missing groups' scores stay stale: masked below */
            const float *kp = kb + (j0 + u) * D;
            if (u + 8 > nk) {  /* a partial group of keys: copy the valid ones, repeat key j0 */
                for (int w = 0; w < 8; ++w)
                    memcpy(kbuf + w * D, kb + (j0 + (u + w < nk ? u + w : 0)) * D, (size_t)D * sizeof(float));
                kp = kbuf;
            }
            int64_t v = va;
            for (; v + 3 <= nv16; v += 3) pf_scores(3, qT + v * 16, kp, D, ST + u * ld + v * 16, ld);
            if (nv16 - v == 2) pf_scores(2, qT + v * 16, kp, D, ST + u * ld + v * 16, ld);
            else if (nv16 - v == 1) pf_scores(1, qT + v * 16, kp, D, ST + u * ld + v * 16, ld);
        }
        /* 2. online softmax, 16 rows per vector: mask keys past each row's position (and a partial
         *    block's missing keys), m, p = exp(s - m), l, alpha = exp(m_old - m) */
        const int masked = j0 + PF_NK - 1 > start + t0;
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        for (int64_t v = va; v < nv16; ++v) {
            const int64_t r = v * 16;
            const __m512i lv = _mm512_loadu_si512(lim + r);
            __m512 mb = ninf;
            for (int j = 0; j < PF_NK; ++j) {
                __m512 s = _mm512_load_ps(ST + j * ld + r);
                if (masked) {
                    const __mmask16 vis = _mm512_cmp_epi32_mask(_mm512_set1_epi32((int32_t)(j0 + j)), lv, _MM_CMPINT_LE);
                    s = _mm512_mask_mov_ps(ninf, vis, s);
                    _mm512_store_ps(ST + j * ld + r, s);
                }
                mb = _mm512_max_ps(mb, s);
            }
            const __m512 mo = _mm512_load_ps(m + r), mn = _mm512_max_ps(mo, mb);
            /* a row that has seen no key yet subtracts 0 (its p and alpha are 0, never NaN) */
            const __m512 ms = _mm512_mask_mov_ps(mn, _mm512_cmp_ps_mask(mn, ninf, _CMP_EQ_OQ), _mm512_setzero_ps());
            const __m512 al = exp16(_mm512_sub_ps(mo, ms));
            __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0;
            for (int j = 0; j < PF_NK; j += 2) {
                const __m512 p0 = exp16(_mm512_sub_ps(_mm512_load_ps(ST + j * ld + r), ms));
                const __m512 p1 = exp16(_mm512_sub_ps(_mm512_load_ps(ST + (j + 1) * ld + r), ms));
                _mm512_store_ps(ST + j * ld + r, p0);
                _mm512_store_ps(ST + (j + 1) * ld + r, p1);
                sum0 = _mm512_add_ps(sum0, p0);
                sum1 = _mm512_add_ps(sum1, p1);
            }
            _mm512_store_ps(l + r, _mm512_fmadd_ps(_mm512_load_ps(l + r), al, _mm512_add_ps(sum0, sum1)));
            _mm512_store_ps(m + r, mn);
            _mm512_store_ps(alpha + r, al);
        }
        /* 3. o = alpha * o + P.V (rows before ra: alpha 1 and p 0, or o still 0) */
        const float *vblk = vb + j0 * D;
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            const int NV = (int)((D - d0) / 16 < 4 ? (D - d0) / 16 : 4);
            for (int64_t r = ra; r < R; r += 6) {
                const int MR = (int)(R - r < 6 ? R - r : 6);
                const float *Pr = ST + r, *vd = vblk + d0, *al = alpha + r;
                float *Or = O + r * D + d0;
                switch (MR) { PO_CASE(6) PO_CASE(5) PO_CASE(4) PO_CASE(3) PO_CASE(2) PO_CASE(1) }
            }
        }
    }
    pf_item_finish(a, &it, b, kv, t0, D);
}

static void pf_item(const pf_t *a, int64_t b, int64_t kv, int64_t t0, int64_t t1, float *scratch) {
    if (a->D == 64) pf_item_d(a, b, kv, t0, t1, scratch, 64);
    else pf_item_d(a, b, kv, t0, t1, scratch, a->D);
}
#endif

/* The AVX2 tiles (module comment above). Transposed scores of 4 keys (rows D apart from k) x NR
 * (1..3) vectors of 8 query rows into ST[u * ld + r] (32-byte aligned): 12 accumulators,
 * broadcast(k[u, d]) x qT[d], the AVX-512 tile's chain per score */
#define P8_ACC(u) __m256 e##u##0 = _mm256_setzero_ps(), e##u##1 = e##u##0, e##u##2 = e##u##0;
#define P8_FMA(u)                                                                     \
    {                                                                                 \
        const __m256 x = _mm256_broadcast_ss(k + (u) * D + d);                        \
        e##u##0 = _mm256_fmadd_ps(x, q0, e##u##0);                                    \
        if (NR > 1) e##u##1 = _mm256_fmadd_ps(x, q1, e##u##1);                        \
        if (NR > 2) e##u##2 = _mm256_fmadd_ps(x, q2, e##u##2);                        \
    }
#define P8_OUT(u)                                                                     \
    {                                                                                 \
        _mm256_store_ps(ST + (u) * ld, e##u##0);                                      \
        if (NR > 1) _mm256_store_ps(ST + (u) * ld + 8, e##u##1);                      \
        if (NR > 2) _mm256_store_ps(ST + (u) * ld + 16, e##u##2);                     \
    }
SS_INLINE void pf8_scores(const int NR, const float *qT, const float *k, const int64_t D, float *ST, int64_t ld) {
    P8_ACC(0) P8_ACC(1) P8_ACC(2) P8_ACC(3)
    for (int64_t d = 0; d < D; ++d) {
        __m256 q0 = _mm256_load_ps(qT + d * ld);
        __m256 q1 = NR > 1 ? _mm256_load_ps(qT + d * ld + 8) : q0;
        __m256 q2 = NR > 2 ? _mm256_load_ps(qT + d * ld + 16) : q0;
        /* in registers: GCC otherwise folds each load into all four FMAs (16 loads per 12 FMAs, 1.2x slower) */
        __asm__("" : "+x"(q0), "+x"(q1), "+x"(q2));
        P8_FMA(0) P8_FMA(1) P8_FMA(2) P8_FMA(3)
    }
    P8_OUT(0) P8_OUT(1) P8_OUT(2) P8_OUT(3)
}

/* o = alpha * o + P.V for MR (1..6) rows x NV (1..2) vectors of 8 columns over kn keys (p of row
 * i, key j at P[j * ld + i]; value rows ldv apart): the AVX-512 tile's chain per element */
#define P8V_ACC(i)                                                                    \
    __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = c##i##0;                          \
    if (MR > i) {                                                                     \
        const __m256 al = _mm256_broadcast_ss(alpha + (i));                           \
        c##i##0 = _mm256_mul_ps(al, _mm256_loadu_ps(out + (i) * ldo));                \
        if (NV > 1) c##i##1 = _mm256_mul_ps(al, _mm256_loadu_ps(out + (i) * ldo + 8)); \
    }
#define P8V_ROW(i)                                                                    \
    if (MR > i) {                                                                     \
        const __m256 pb = _mm256_broadcast_ss(P + j * ld + (i));                      \
        c##i##0 = _mm256_fmadd_ps(pb, v0, c##i##0);                                   \
        if (NV > 1) c##i##1 = _mm256_fmadd_ps(pb, v1, c##i##1);                       \
    }
#define P8V_OUT(i)                                                                    \
    if (MR > i) {                                                                     \
        _mm256_storeu_ps(out + (i) * ldo, c##i##0);                                   \
        if (NV > 1) _mm256_storeu_ps(out + (i) * ldo + 8, c##i##1);                   \
    }
SS_INLINE void pf8_pv(const int MR, const int NV, int64_t kn, const float *P, int64_t ld, const float *v, int64_t ldv,
                      float *out, int64_t ldo, const float *alpha) {
    P8V_ACC(0) P8V_ACC(1) P8V_ACC(2) P8V_ACC(3) P8V_ACC(4) P8V_ACC(5)
    for (int64_t j = 0; j < kn; ++j) {
        const __m256 v0 = _mm256_loadu_ps(v + j * ldv);
        const __m256 v1 = NV > 1 ? _mm256_loadu_ps(v + j * ldv + 8) : v0;
        P8V_ROW(0) P8V_ROW(1) P8V_ROW(2) P8V_ROW(3) P8V_ROW(4) P8V_ROW(5)
    }
    P8V_OUT(0) P8V_OUT(1) P8V_OUT(2) P8V_OUT(3) P8V_OUT(4) P8V_OUT(5)
}
#define P8V_CASE(MR_)                                                                 \
    case MR_:                                                                         \
        if (NV == 2) pf8_pv(MR_, 2, nk, Pr, ld, vd, D, Or, D, al);                    \
        else pf8_pv(MR_, 1, nk, Pr, ld, vd, D, Or, D, al);                            \
        break;

/* pf_item_d in AVX2 tiles (the same item layout, pf_item_start, and output, pf_item_finish) */
SS_INLINE void pf8_item_d(const pf_t *a, int64_t b, int64_t kv, int64_t t0, int64_t t1, float *scratch,
                          const int64_t D) {
    const pf_item_t it = pf_item_start(a, b, kv, t0, t1, scratch, D);
    const int64_t G = a->G, R = it.R, start = it.start, n = it.n, ld = it.ld, nv8 = ld / 8;
    float *qT = it.qT, *ST = it.ST, *m = it.m, *l = it.l, *alpha = it.alpha, *O = it.O, *kbuf = it.kbuf;
    const int32_t *lim = it.lim;
    const float *kb = it.kb, *vb = it.vb;
    const __m256 ninf = _mm256_set1_ps(-INFINITY), zero = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < n; j0 += PF_NK) {
        const int nk = (int)(n - j0 < PF_NK ? n - j0 : PF_NK);
        const int64_t tmin = j0 - start;
        const int64_t ra = tmin > t0 ? (tmin - t0) * G : 0, va = ra / 8;
        /* 1. scores, 4 keys x 24 rows per tile, the block's keys for one 24-row slice of qT at a
         *    time (both stay in L1); a partial group repeats key j0 (masked below) */
        const int nu = (nk + 3) / 4 * 4, full = nk / 4 * 4;
        if (nk % 4)
            for (int w = 0; w < 4; ++w)
                memcpy(kbuf + w * D, kb + (j0 + (full + w < nk ? full + w : 0)) * D, (size_t)D * sizeof(float));
        for (int64_t v = va; v < nv8; v += 3) {
            const int NR = (int)(nv8 - v < 3 ? nv8 - v : 3);
            for (int u = 0; u < nu; u += 4) {
                const float *kp = u + 4 > nk ? kbuf : kb + (j0 + u) * D;
                float *st = ST + u * ld + v * 8;
                if (NR == 3) pf8_scores(3, qT + v * 8, kp, D, st, ld);
                else if (NR == 2) pf8_scores(2, qT + v * 8, kp, D, st, ld);
                else pf8_scores(1, qT + v * 8, kp, D, st, ld);
            }
        }
        /* 2. online softmax, 8 rows per vector (pf_item_d's operations) */
        const int masked = j0 + PF_NK - 1 > start + t0;
        for (int64_t v = va; v < nv8; ++v) {
            const int64_t r = v * 8;
            const __m256i lv = _mm256_loadu_si256((const __m256i *)(lim + r));
            __m256 mb = ninf;
            for (int j = 0; j < PF_NK; ++j) {
                __m256 s = _mm256_load_ps(ST + j * ld + r);
                if (masked) {
                    const __m256i hid = _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)(j0 + j)), lv);
                    s = _mm256_blendv_ps(s, ninf, _mm256_castsi256_ps(hid));
                    _mm256_store_ps(ST + j * ld + r, s);
                }
                mb = _mm256_max_ps(mb, s);
            }
            const __m256 mo = _mm256_load_ps(m + r), mn = _mm256_max_ps(mo, mb);
            const __m256 ms = _mm256_blendv_ps(mn, zero, _mm256_cmp_ps(mn, ninf, _CMP_EQ_OQ));
            const __m256 al = exp8(_mm256_sub_ps(mo, ms));
            __m256 sum0 = zero, sum1 = zero;
            for (int j = 0; j < PF_NK; j += 2) {
                const __m256 p0 = exp8(_mm256_sub_ps(_mm256_load_ps(ST + j * ld + r), ms));
                const __m256 p1 = exp8(_mm256_sub_ps(_mm256_load_ps(ST + (j + 1) * ld + r), ms));
                _mm256_store_ps(ST + j * ld + r, p0);
                _mm256_store_ps(ST + (j + 1) * ld + r, p1);
                sum0 = _mm256_add_ps(sum0, p0);
                sum1 = _mm256_add_ps(sum1, p1);
            }
            _mm256_store_ps(l + r, _mm256_fmadd_ps(_mm256_load_ps(l + r), al, _mm256_add_ps(sum0, sum1)));
            _mm256_store_ps(m + r, mn);
            _mm256_store_ps(alpha + r, al);
        }
        /* 3. o = alpha * o + P.V */
        const float *vblk = vb + j0 * D;
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            const int NV = D - d0 >= 16 ? 2 : 1;
            for (int64_t r = ra; r < R; r += 6) {
                const int MR = (int)(R - r < 6 ? R - r : 6);
                const float *Pr = ST + r, *vd = vblk + d0, *al = alpha + r;
                float *Or = O + r * D + d0;
                switch (MR) { P8V_CASE(6) P8V_CASE(5) P8V_CASE(4) P8V_CASE(3) P8V_CASE(2) P8V_CASE(1) }
            }
        }
    }
    pf_item_finish(a, &it, b, kv, t0, D);
}

static void pf8_item(const pf_t *a, int64_t b, int64_t kv, int64_t t0, int64_t t1, float *scratch) {
    if (a->D == 64) pf8_item_d(a, b, kv, t0, t1, scratch, 64);  /* D = 64 a constant: the d-loops unrolled */
    else pf8_item_d(a, b, kv, t0, t1, scratch, a->D);
}

/* Causal attention of a prefill chunk (module comment above): q [B, H_kv * G, T, D] contiguous,
 * the chunk's keys and values already in the cache at starts[b] .. starts[b] + T - 1, out as
 * ss_attention's. Returns 0; -1 where D % 16 != 0 (nothing written); -2 when a thread could not
 * allocate its scratch (the output is incomplete). */
SS_API int ss_prefill_attention(int64_t B, int64_t Hkv, int64_t G, int64_t T, int64_t D, const float *q,
                                const float *k, int64_t k_sb, int64_t k_sh, const float *v, int64_t v_sb,
                                int64_t v_sh, const int64_t *starts, float scale, float *out, int64_t o_sb,
                                int64_t o_st, int nthreads) {
    if (D % 16 != 0 || D <= 0) return -1;
    pf_t a = {B, Hkv, G, T, D, q, k, v, k_sb, k_sh, v_sb, v_sh, starts, scale, out, o_sb, o_st};
    const int64_t tq = G >= PF_ROWS ? 1 : PF_ROWS / G, nq = (T + tq - 1) / tq, items = B * Hkv * nq;
    const int64_t floats = pf_scratch_floats(G * tq, D);
#if SS_HAVE512
    const int wide = ss_att512;  /* the AVX-512 tiles (the same bits as the AVX2 ones) */
#endif
    int failed = 0;
#pragma omp parallel num_threads(ss_threads(nthreads))
    {
        float *scratch = aligned_alloc(64, (size_t)((floats * 4 + 63) / 64 * 64));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; ++i) {
            const int64_t p = i / nq, c = i % nq, t0 = c * tq, t1 = t0 + tq < T ? t0 + tq : T;
            if (!scratch) continue;
#if SS_HAVE512
            if (wide) {
                pf_item(&a, p / Hkv, p % Hkv, t0, t1, scratch);
                continue;
            }
#endif
            pf8_item(&a, p / Hkv, p % Hkv, t0, t1, scratch);
        }
        free(scratch);
    }
    return failed ? -2 : 0;
}

/* Sparse draft attention: each row attends to its first n_valid[b] indexed cache positions plus
 * the E draft-tail slots (causal among the T queries). Needs D % 16 == 0. */
SS_API void ss_sparse_attention(int64_t B, int64_t Hkv, int64_t G, int64_t T, int64_t D, const float *q,
                                const float *k, int64_t k_sb, int64_t k_sh, const float *v, int64_t v_sb,
                                int64_t v_sh, const int32_t *index, int64_t i_sb, int64_t i_sh,
                                const int64_t *n_valid, const float *kt, const float *vt, int64_t t_sb,
                                int64_t t_sh, int64_t E, float scale, float *out, int64_t o_sb, int64_t o_st,
                                float *ws, int64_t n_max, int nthreads) {
    attn_t a;
    memset(&a, 0, sizeof a);
    a.B = B; a.Hkv = Hkv; a.G = G; a.T = T; a.D = D; a.q = q;
    a.k = k; a.k_sb = k_sb; a.k_sh = k_sh; a.v = v; a.v_sb = v_sb; a.v_sh = v_sh;
    a.index = index; a.i_sb = i_sb; a.i_sh = i_sh; a.n_valid = n_valid;
    a.kt = kt; a.vt = vt; a.t_sb = t_sb; a.t_sh = t_sh; a.E = E;
    a.scale = scale; a.out = out; a.o_sb = o_sb; a.o_st = o_st;
    a.ws = ws; a.n_max = n_max; a.sparse = 1;
    att_run(&a, nthreads);
}

/* ------------------------------------------------------------------ every layer in one call
 * A decode / verify / draft forward's decoder layers in one parallel region (one call from Python
 * instead of ten per layer, one fork instead of ten): per layer, on the residual stream h [B*T, E],
 *   x = rms(h, ln_attn); qkv = x Wqkv^T (+ b); q, k, v = rope(qkv), k and v written where the
 *   attention reads them; a = attention; h += a Wo^T; x = rms(h, ln_mlp); gu = x Wgu^T;
 *   h += silu_mul(gu) Wdown^T
 * with the same kernels (so the same bits) as the separate calls. Every field is 8 bytes. */
typedef struct {
    int64_t B, T, L, E, H, Hkv, D, I;
    double eps, scale;
    int64_t nthreads;
    float *h;                                   /* [B*T, E] in: embeddings; out: the last layer's output */
    const float *cosv, *sinv;                   /* [B*T, D] */
    const float *const *ln_attn, *const *ln_mlp; /* [L] pointers to [E] */
    const float *const *wqkv, *const *bqkv;     /* [L] pointers: panels of Wqkv; its bias or NULL (bqkv NULL: none) */
    const float *const *wo, *const *wgu, *const *wdown;  /* [L] pointers to panels */
    float *k, *v;                               /* dense cache base; layer l at + l * k_sl */
    int64_t k_sl, k_sb, k_sh, v_sl, v_sb, v_sh;
    const int64_t *starts;                      /* [B] each row's length before the forward (dense) */
    const int64_t *kv_pos;                      /* [B] where token 0's k, v go: starts (dense), E_tail - T (draft tail) */
    float *rows;                                /* importance rows base or NULL; layer l at + l * r_sl */
    int64_t r_sl, r_sb, r_sh, r_sw, W;
    const int64_t *slots;                       /* [B, W] or NULL (slot w) */
    int64_t sparse;                             /* 1: the draft (index + tail), T == 1 */
    const int32_t *index;                       /* [L, B, H_kv, N] base, strides i_sl, i_sb, i_sh */
    int64_t i_sl, i_sb, i_sh;
    const int64_t *n_valid;                     /* [B] */
    float *kt, *vt;                             /* the draft's tail base; layer l at + l * t_sl */
    int64_t t_sl, t_sb, t_sh, E_tail;           /* tail slots 0 .. E_tail - 1 attended; the new token at E_tail - 1 */
    float *x, *qkv, *q, *att, *gu, *act, *ws;   /* scratch: [BT, E], [BT, (H+2Hkv)D], [B,H,T,D], [BT, HD], [BT, 2I], [BT, I], attention */
    int64_t n_max;                              /* keys of the longest row */
    float *feat;                                /* hidden-state features or NULL: [B*T, n_feat * E], row stride feat_ld */
    int64_t feat_ld, n_feat;
    const int64_t *feat_layers;                 /* [n_feat] layer ids (may repeat): slot j = h after layer feat_layers[j] */
} fwd_t;

SS_API int64_t ss_forward_struct_size(void) { return (int64_t)sizeof(fwd_t); }

SS_API void ss_forward_layers(const fwd_t *f) {
    const int64_t BT = f->B * f->T, E = f->E, H = f->H, Hkv = f->Hkv, D = f->D, I = f->I;
    const int64_t Nqkv = (H + 2 * Hkv) * D;
#pragma omp parallel num_threads(ss_threads((int)f->nthreads))
    {
        for (int64_t l = 0; l < f->L; ++l) {
            rms_body(BT, E, f->h, E, f->ln_attn[l], (float)f->eps, f->x, E);
            lin_packed_body(BT, Nqkv, E, f->x, E, f->wqkv[l], f->bqkv ? f->bqkv[l] : NULL, f->qkv, Nqkv, 0);
            attn_t a;
            memset(&a, 0, sizeof a);
            a.B = f->B; a.Hkv = Hkv; a.G = H / Hkv; a.T = f->T; a.D = D; a.q = f->q;
            a.k = f->k + l * f->k_sl; a.k_sb = f->k_sb; a.k_sh = f->k_sh;
            a.v = f->v + l * f->v_sl; a.v_sb = f->v_sb; a.v_sh = f->v_sh;
            a.scale = (float)f->scale; a.out = f->att; a.o_sb = f->T * H * D; a.o_st = H * D;
            a.ws = f->ws; a.n_max = f->n_max;
            if (f->sparse) {
                float *kt = f->kt + l * f->t_sl, *vt = f->vt + l * f->t_sl;
                rope_body(f->B, f->T, H, Hkv, D, f->qkv, Nqkv, f->cosv, f->sinv, f->q, kt, f->t_sb, f->t_sh, vt,
                          f->t_sb, f->t_sh, f->kv_pos);
                a.sparse = 1; a.index = f->index + l * f->i_sl; a.i_sb = f->i_sb; a.i_sh = f->i_sh;
                a.n_valid = f->n_valid; a.kt = kt; a.vt = vt; a.t_sb = f->t_sb; a.t_sh = f->t_sh; a.E = f->E_tail;
            } else {
                rope_body(f->B, f->T, H, Hkv, D, f->qkv, Nqkv, f->cosv, f->sinv, f->q, (float *)a.k, a.k_sb, a.k_sh,
                          (float *)a.v, a.v_sb, a.v_sh, f->kv_pos);
                a.starts = f->starts;
                if (f->rows) {
                    a.rows = f->rows + l * f->r_sl; a.r_sb = f->r_sb; a.r_sh = f->r_sh; a.r_sw = f->r_sw;
                    a.W = f->W; a.S_rows = f->n_max; a.slots = f->slots;
                }
            }
            att_body(&a);
            lin_packed_body(BT, E, H * D, f->att, H * D, f->wo[l], NULL, f->h, E, 1);
            rms_body(BT, E, f->h, E, f->ln_mlp[l], (float)f->eps, f->x, E);
            lin_packed_body(BT, 2 * I, E, f->x, E, f->wgu[l], NULL, f->gu, 2 * I, 0);
            silu_body(BT, I, f->gu, 2 * I, f->act, I);
            lin_packed_body(BT, E, I, f->act, I, f->wdown[l], NULL, f->h, E, 1);
            if (f->feat) {  /* copies of this layer's output where asked (what an EAGLE-3 head reads) */
                for (int64_t j = 0; j < f->n_feat; ++j) {
                    if (f->feat_layers[j] != l) continue;
#pragma omp for schedule(static)
                    for (int64_t r = 0; r < BT; ++r)
                        memcpy(f->feat + r * f->feat_ld + j * E, f->h + r * E, (size_t)E * sizeof(float));
                }
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------ *
 * The sparse index (sparsespec/kv/index.py build_index): per row (layer, KV head) of float64
 * importance scores over `length` keys, the positions [0, n_sink), the n_top = budget - n_sink -
 * n_recent highest-scoring of [n_sink, length - n_recent), and [length - n_recent, length), in
 * ascending order. The n_top-th largest score is found by a radix select over the scores' bits
 * (an order-preserving map of the doubles: 11 bits per pass, each pass over the previous pass's
 * candidates only), then one pass in position order emits every key above it and, of the keys
 * equal to it, the earliest: no sort, about four passes over the row. The passes start below the
 * bits every key shares (min and max agree there). At 30 layers x 3 heads x 6K keys per batch row
 * on the AMD EPYC, 2 threads: 1.05 ms against 3.9 ms for torch.topk + sort. Caller: budget <
 * length, n_sink + n_recent <= budget.
 * ------------------------------------------------------------------------------------------ */
SS_INLINE uint64_t ss_order_key(double x) {
    uint64_t u;
    memcpy(&u, &x, 8);
    return (u >> 63) ? ~u : (u | 0x8000000000000000ULL);
}

static void index_row(const double *s, int64_t length, int64_t n_sink, int64_t n_recent, int64_t budget,
                      int64_t *o, uint64_t *key, int64_t *cand) {
    const int64_t m = length - n_sink - n_recent, n_top = budget - n_sink - n_recent;
    int64_t w = 0;
    for (int64_t i = 0; i < n_sink; ++i) o[w++] = i;
    if (n_top > 0) {
        const double *mid = s + n_sink;
        uint64_t lo = ~0ULL, hi = 0;
        for (int64_t i = 0; i < m; ++i) {
            const uint64_t k = ss_order_key(mid[i]);
            key[i] = k;
            lo = k < lo ? k : lo;
            hi = k > hi ? k : hi;
        }
        uint32_t hist[1 << 11];
        /* every key shares the bits above the highest bit where min and max differ: start there
         * (importance scores share sign and most of the exponent: a pass on them selects nothing) */
        int shift = lo == hi ? 0 : 64 - __builtin_clzll(lo ^ hi);
        uint64_t prefix = shift < 64 ? lo >> shift : 0;
        int64_t need = n_top, nc = m;  /* all keys equal (shift 0): the earliest n_top */
        int first = 1;
        while (shift > 0) {
            const int bits = shift >= 11 ? 11 : shift;
            shift -= bits;
            const uint64_t mask = (1ULL << bits) - 1;
            memset(hist, 0, sizeof(uint32_t) << bits);
            if (first)
                for (int64_t i = 0; i < m; ++i) hist[(key[i] >> shift) & mask]++;
            else
                for (int64_t c = 0; c < nc; ++c) hist[(key[cand[c]] >> shift) & mask]++;
            int64_t acc = 0, bin = (int64_t)mask;
            for (; bin > 0; --bin) {  /* the bin holding the need-th largest, counting from the top */
                if (acc + hist[bin] >= need) break;
                acc += hist[bin];
            }
            need -= acc;
            int64_t n2 = 0;  /* the candidates left: those in that bin, in position order */
            if (first) {
                for (int64_t i = 0; i < m; ++i)
                    if (((key[i] >> shift) & mask) == (uint64_t)bin) cand[n2++] = i;
            } else {
                for (int64_t c = 0; c < nc; ++c)
                    if (((key[cand[c]] >> shift) & mask) == (uint64_t)bin) cand[n2++] = cand[c];
            }
            first = 0;
            nc = n2;
            prefix = (prefix << bits) | (uint64_t)bin;
            if (need == nc) break;  /* the whole bin is in */
        }
        /* keys above the prefix are in; of the candidates (prefix equal), the first `need`:
         * branch-free (the selected keys are scattered), written into cand (m > n_top: room for
         * the one write past the last kept key) */
        int64_t p = 0, nw = 0;
        for (int64_t i = 0; i < m; ++i) {
            const uint64_t k = key[i] >> shift;
            const int64_t eq = k == prefix;
            cand[nw] = n_sink + i;
            nw += (k > prefix) | (eq & (p < need));
            p += eq;
        }
        memcpy(o + w, cand, (size_t)n_top * 8);
        w += n_top;
    }
    for (int64_t i = length - n_recent; i < length; ++i) o[w++] = i;
}

SS_API void ss_build_index(int64_t R0, int64_t R1, const double *scores, int64_t s0, int64_t s1, int64_t length,
                           int64_t n_sink, int64_t n_recent, int64_t budget, int64_t *out, int64_t o0, int64_t o1,
                           int nthreads) {
    const int64_t m = length - n_sink - n_recent;
    #pragma omp parallel num_threads(nthreads)
    {
        uint64_t *key = (uint64_t *)malloc((size_t)(m > 0 ? m : 1) * 8);
        int64_t *cand = (int64_t *)malloc((size_t)(m > 0 ? m : 1) * 8);
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < R0 * R1; ++r) {
            const int64_t a = r / R1, h = r % R1;
            index_row(scores + a * s0 + h * s1, length, n_sink, n_recent, budget, out + a * o0 + h * o1, key, cand);
        }
        free(key);
        free(cand);
    }
}

/* the distance (rows) at which the copies fetch their source and destination rows ahead: scattered
 * rows waited for one at a time ran at 3-10 GB/s on the AMD EPYC */
#ifndef SS_COPY_PF
#define SS_COPY_PF 8
#endif
SS_INLINE void copy_rows_prefetched(int64_t m, const float *const *sk, const float *const *sv, float *const *dk,
                                    float *const *dv, int64_t D) {
    const size_t row = (size_t)D * 4;
    for (int64_t i = 0; i < m; ++i) {
        if (i + SS_COPY_PF < m) {
            const int64_t a = i + SS_COPY_PF;
            for (size_t o = 0; o < row; o += 64) {
                _mm_prefetch((const char *)sk[a] + o, _MM_HINT_T0);
                _mm_prefetch((const char *)sv[a] + o, _MM_HINT_T0);
                __builtin_prefetch((const char *)dk[a] + o, 1);
                __builtin_prefetch((const char *)dv[a] + o, 1);
            }
        }
        memcpy(dk[i], sk[i], row);
        memcpy(dv[i], sv[i], row);
    }
}

/* ------------------------------------------------------------------ the draft's compact KV
 * One batch row's indexed keys and values, kept in a compact buffer across rebuilds of its index,
 * so that every draft step streams N contiguous rows instead of reading N scattered ones (random
 * 256-byte rows of K and V: about half the streaming rate on the AMD EPYC of benchmarks/RESULTS.md),
 * and a rebuild copies only the positions that entered the index (about a tenth of them per round
 * of sparsespec-l on book text).
 *
 * Per (layer, KV head) list: the state is the positions now held, ascending (pos[0 .. n_cur)), and
 * the compact slot of each (slot[...]); the slots in use are exactly 0 .. n_cur - 1. Given the new
 * index (idx[0 .. n), ascending, unique), a position in both keeps its slot unless that slot is >= n
 * (the index shrank: its row moves down into a free slot); a position only in the new index is
 * copied from the cache into a free slot below n. Afterwards the state describes the new index and
 * the slots in use are 0 .. n - 1. Order of the compact rows: arbitrary (attention over them is
 * the same sum in another order; only the draft reads them).
 *
 * idx: [L, H] lists (strides x_sl, x_sh) of int64; pos, slot: [L, H, >= max(n, n_cur)] int32 (strides
 * s_sl, s_sh); k, v: the cache row [L, H, S, D] (strides c_sl, c_sh, rows of D contiguous); ck, cv:
 * the compact row [L, H, >= n, D] (strides p_sl, p_sh). Returns the rows copied (moves included),
 * or -1 where a thread could not allocate its scratch (then the state is unchanged for the lists it
 * did not reach: call again with n_cur = 0 to rebuild from scratch). */
static int64_t compact_list(const int64_t *idx, int64_t n, int32_t *pos, int32_t *slot, int64_t n_cur,
                            const float *k, const float *v, int64_t c_row, float *ck, float *cv, int64_t D,
                            unsigned char *used, int32_t *out, const float **sk, const float **sv, float **dk,
                            float **dv) {
    const int64_t top = n > n_cur ? n : n_cur;
    memset(used, 0, (size_t)top);
    for (int64_t i = 0, j = 0; i < n_cur && j < n;) {  /* 1. the slots below n that kept positions hold */
        const int64_t a = pos[i], b = idx[j];
        if (a == b) {
            if (slot[i] < n) used[slot[i]] = 1;
            ++i, ++j;
        } else if (a < b) {
            ++i;
        } else {
            ++j;
        }
    }
    /* 2. assign: kept (moved down where needed), added into free slots; the copies listed, then
     *    made with their rows fetched ahead (no source is another copy's destination: a moved row
     *    leaves a slot >= n, an added one fills a free slot) */
    int64_t f = 0, copied = 0;
    for (int64_t i = 0, j = 0; j < n; ++j) {
        const int64_t b = idx[j];
        while (i < n_cur && pos[i] < b) ++i;
        int64_t s;
        if (i < n_cur && pos[i] == b) {
            s = slot[i++];
            if (s >= n) {
                while (used[f]) ++f;
                used[f] = 1;
                sk[copied] = ck + s * D, sv[copied] = cv + s * D;
                dk[copied] = ck + f * D, dv[copied] = cv + f * D;
                ++copied;
                s = f;
            }
        } else {
            while (used[f]) ++f;
            used[f] = 1;
            s = f;
            sk[copied] = k + b * c_row, sv[copied] = v + b * c_row;
            dk[copied] = ck + s * D, dv[copied] = cv + s * D;
            ++copied;
        }
        out[j] = (int32_t)s;
    }
    copy_rows_prefetched(copied, sk, sv, dk, dv, D);
    for (int64_t j = 0; j < n; ++j) {
        pos[j] = (int32_t)idx[j];
        slot[j] = out[j];
    }
    return copied;
}

SS_API int64_t ss_compact_update(int64_t L, int64_t H, int64_t D, const int64_t *idx, int64_t x_sl, int64_t x_sh,
                                 int64_t n, int32_t *pos, int32_t *slot, int64_t s_sl, int64_t s_sh, int64_t n_cur,
                                 const float *k, const float *v, int64_t c_sl, int64_t c_sh, float *ck, float *cv,
                                 int64_t p_sl, int64_t p_sh, int nthreads) {
    const int64_t top = n > n_cur ? n : n_cur;
    int64_t copied = 0;
    int failed = 0;
#pragma omp parallel num_threads(ss_threads(nthreads)) reduction(+ : copied) reduction(| : failed)
    {
        const size_t nn = (size_t)(n > 0 ? n : 1);
        unsigned char *used = (unsigned char *)malloc((size_t)(top > 0 ? top : 1));
        int32_t *out = (int32_t *)malloc(nn * 4);
        void **lists = (void **)malloc(nn * 4 * sizeof(void *));  /* the copies' source and destination rows */
        failed = used == NULL || out == NULL || lists == NULL;
#pragma omp for schedule(dynamic, 4)
        for (int64_t r = 0; r < L * H; ++r) {
            if (failed) continue;
            const int64_t l = r / H, h = r % H;
            copied += compact_list(idx + l * x_sl + h * x_sh, n, pos + l * s_sl + h * s_sh, slot + l * s_sl + h * s_sh,
                                   n_cur, k + l * c_sl + h * c_sh, v + l * c_sl + h * c_sh, D, ck + l * p_sl + h * p_sh,
                                   cv + l * p_sl + h * p_sh, D, used, out, (const float **)lists,
                                   (const float **)lists + nn, (float **)lists + 2 * nn, (float **)lists + 3 * nn);
        }
        free(used);
        free(out);
        free(lists);
    }
    return failed ? -1 : copied;
}
