// Linear layers over block-quantized weights that hold exactly the model's float32 values (block_linear.h).
//
//   q4_linear: w[n, k] = d[n, b] * q + m[n, b]   q in [0, 15] (4 bits), b = k / 32     (GGUF Q4_1 values)
//   q8_linear: w[n, k] = d[n, b] * q             q in [-127, 127] (8 bits)             (GGUF Q8_0 values)
//
// d and m are float16 values stored as float32, so d * q is exact in float32 and fma(d, q, m) rounds once,
// exactly as the float32 weights were computed from the file: every weight the kernel uses is bit for bit
// the model's weight. Only the summation order of the dot products differs from a float32 GEMM.
// out[M, N] = x[M, K] @ w^T, float32, K a multiple of 32. AVX2 + FMA; a scalar loop elsewhere.
//
// Row-invariant: every row of x is summed in the same order whatever M is and wherever the row sits in a
// tile, so a row's output bits never depend on the other rows (speculative verification of N rows gives
// each row what a one-row forward gives it; docs/kernels.md, "bitwise mode").

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <cstdint>

#include "block_linear.h"

namespace treespec {
namespace {

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 weights of one Q4_1 block: bytes j hold q[j] (low nibble) and q[j + 16] (high nibble).
inline void q4_block(const uint8_t* qs, float d, float m, __m256 w[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  w[0] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vm);
  w[1] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vm);
  w[2] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vm);
  w[3] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vm);
}

inline void q8_block(const int8_t* qs, float d, __m256 w[4]) {
  const __m256 vd = _mm256_set1_ps(d);
  for (int i = 0; i < 4; ++i) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i));
    w[i] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
  }
}

// R rows of x against one weight row n: out[r, n] for r < R. Each row sums into the same 4 independent
// accumulators (the block's 8-wide quarters q go to accumulator q) for every R, then adds them in one
// fixed order: the row-invariant summation order (one chain of dependent FMAs per row would also leave a
// one-row product waiting on the FMA latency four times per block).
template <int R, bool Q4>
inline void row_tile(const float* x, int64_t K, const void* qrow, const float* d, const float* m, float* out,
                     int64_t N) {
  constexpr int C = 4;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t blocks = K / 32;
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 w[4];
    if (Q4)
      q4_block(static_cast<const uint8_t*>(qrow) + 16 * b, d[b], m[b], w);
    else
      q8_block(static_cast<const int8_t*>(qrow) + 32 * b, d[b], w);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * K + 32 * b;
      for (int q = 0; q < 4; ++q)
        acc[r][q % C] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8 * q), w[q], acc[r][q % C]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 sum = acc[r][0];
    for (int c = 1; c < C; ++c) sum = _mm256_add_ps(sum, acc[r][c]);
    out[r * N] = hsum(sum);
  }
}
#endif

template <bool Q4>
inline void scalar_row(const float* x, int64_t K, const void* qrow, const float* d, const float* m, float* out) {
  float acc = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t b = k / 32, j = k % 32;
    float w;
    if (Q4) {
      const uint8_t byte = static_cast<const uint8_t*>(qrow)[16 * b + (j % 16)];
      const int q = j < 16 ? (byte & 0x0F) : (byte >> 4);
      w = __builtin_fmaf(d[b], static_cast<float>(q), m[b]);
    } else {
      w = d[b] * static_cast<float>(static_cast<const int8_t*>(qrow)[k]);
    }
    acc += x[k] * w;
  }
  *out = acc;
}

// x rows per tile: R x 4 accumulators + 4 weight registers + 1 load must fit the register file (32 vector
// registers with AVX-512VL, 16 with AVX2 only)
#if defined(__AVX512VL__)
constexpr int kRows = 6;
#else
constexpr int kRows = 2;
#endif

template <bool Q4>
void quant_linear(const float* x, int64_t M, int64_t K, const void* q, const float* d, const float* m, float* out,
                  int64_t N) {
  const int64_t row_bytes = Q4 ? K / 2 : K;
  const int64_t blocks = K / 32;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const void* qrow = static_cast<const uint8_t*>(q) + n * row_bytes;
    const float* dn = d + n * blocks;
    const float* mn = Q4 ? m + n * blocks : nullptr;
#if defined(__AVX2__) && defined(__FMA__)
    int64_t r = 0;
    for (; r + kRows <= M; r += kRows) row_tile<kRows, Q4>(x + r * K, K, qrow, dn, mn, out + r * N + n, N);
    switch (M - r) {
      case 1: row_tile<1, Q4>(x + r * K, K, qrow, dn, mn, out + r * N + n, N); break;
      case 2: row_tile<2, Q4>(x + r * K, K, qrow, dn, mn, out + r * N + n, N); break;
      case 3: row_tile<3, Q4>(x + r * K, K, qrow, dn, mn, out + r * N + n, N); break;
      case 4: row_tile<4, Q4>(x + r * K, K, qrow, dn, mn, out + r * N + n, N); break;
      case 5: row_tile<5, Q4>(x + r * K, K, qrow, dn, mn, out + r * N + n, N); break;
      default: break;
    }
#else
    for (int64_t r = 0; r < M; ++r) scalar_row<Q4>(x + r * K, K, qrow, dn, mn, out + r * N + n);
#endif
  }
}

}  // namespace

void q4_linear_cpu(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* d, const float* m,
                   float* out, int64_t N) {
  quant_linear<true>(x, M, K, q, d, m, out, N);
}

void q8_linear_cpu(const float* x, int64_t M, int64_t K, const int8_t* q, const float* d, float* out, int64_t N) {
  quant_linear<false>(x, M, K, q, d, nullptr, out, N);
}

}  // namespace treespec
