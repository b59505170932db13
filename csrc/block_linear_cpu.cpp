// Linear layers over block-quantized weights that hold exactly the model's float32 values (block_linear.h).
//
//   q4_linear: w[n, k] = d[n, b] * q + m[n, b]   q in [0, 15] (4 bits), b = k / 32     (GGUF Q4_1 values)
//   q8_linear: w[n, k] = d[n, b] * q             q in [-127, 127] (8 bits)             (GGUF Q8_0 values)
//
// d and m are float16 values (stored as float32 or as their float16 bits), so d * q is exact in float32 and
// fma(d, q, m) rounds once, exactly as the float32 weights were computed from the file: every weight the
// kernel uses is bit for bit the model's weight. Only the summation order of the dot products differs from a
// float32 GEMM.
//
// Engines: AVX-512 (16 lanes: a block is two vectors), AVX2 + FMA (8 lanes: four vectors), scalar. Each
// output sums into one accumulator per vector of a block (block after block, one FMA each), then adds the
// accumulators and their lanes in one fixed order: the row-invariant summation order. A tile of R rows x C
// weight rows rebuilds each weight block once (in registers) for all R rows, and keeps 2RC (AVX-512)
// independent FMA chains in flight, so one row (a plain step) is not bound by the FMA latency and many
// rows (a verified tree) pay for the arithmetic, not for rebuilding the weights. AVX2's registers hold tiles
// of only 2 rows, so there three or more rows decode the weights once into a buffer instead (decoded_tile:
// the same operations per output in the same order); their one- and two-row tiles are bound by the shuffle
// units, so a Q4_1 block is widened from memory in two halves (block_weights) and a tile builds one weight
// row's block at a time. On AVX-512 a Q4_1 block's weights are looked up in its 16-value table (block_weights),
// with x read in the lookup's lane order; one-row tiles convert float16 scales 16 blocks at a time
// (TileScales). Measured on a 2-core Zen 4 EPYC (log 2026-12-07-e): a 32-weight Q4_1 block-row at one row
// 2.2 -> 1.9 ns from DRAM, at four rows 1.2 -> 0.9 ns.

#include <immintrin.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_linear.h"
#include "exact.h"

namespace treespec {
namespace {

// Block scale i of a [N, K / 32] array of float32 values (Half false) or of float16 bits (Half true; the
// same values, half the bytes): exact either way.
template <bool Half>
inline float scale_at(const void* s, int64_t i) {
  if constexpr (Half) {
    const uint16_t h = static_cast<const uint16_t*>(s)[i];
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return half_to_float(h);
#endif
  } else {
    return static_cast<const float*>(s)[i];
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TREESPEC_BLOCK_AVX512 1
constexpr int PV = 2;  // vectors per block
typedef __m512 bvec;

// Q4_1 weights on AVX-512 are looked up, not converted: a block's 16 possible weights fma(d, j, m), j = 0..15,
// are one vector (the block's table, the same fma as the model's own weights: bit for bit), and vpermps picks
// each lane's weight by the low 4 bits of its index. The block's 16 quant bytes are broadcast to the four
// 128-bit lanes and shifted per lane (vpsrlvd), so that lane t of vector v holds in its low bits the nibble
// of k = 32b + 16v + 4 (t % 4) + t / 4: no widening shuffle, no int -> float conversion. x is read in the
// same order (q4_lane_order permutes each row once per call).
inline int q4_lane_k(int v, int t) { return 16 * v + 4 * (t % 4) + t / 4; }

// The 32 weights of block b of one weight row: Q8_0 w[0] = k in [32b, 32b + 16), w[1] = [32b + 16, 32b + 32);
// Q4_1 w[v] lane t = k 32b + q4_lane_k(v, t).
template <bool Q4>
inline void block_weights(const uint8_t* q, int64_t b, float d, float m, bvec w[PV]) {
  const __m512 vd = _mm512_set1_ps(d);
  if (Q4) {
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(vd, values, _mm512_set1_ps(m));
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * b)));
    // lane t reads dword t % 4 (bytes 4 (t % 4) .. + 3) and takes byte t / 4's low (v = 0) or high nibble
    const __m512i low = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
    const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(4));
    w[0] = _mm512_permutexvar_ps(_mm512_srlv_epi32(bytes, low), table);
    w[1] = _mm512_permutexvar_ps(_mm512_srlv_epi32(bytes, high), table);
  } else {
    const int8_t* s = reinterpret_cast<const int8_t*>(q) + 32 * b;
    w[0] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)))));
    w[1] = _mm512_mul_ps(
        vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16)))));
  }
}

// Rows x[M, K] in the lane order of the Q4_1 weights (q4_lane_k) into xt[M, K]: one vpermps per 16 floats.
inline void q4_lane_order(const float* x, int64_t M, int64_t K, float* xt) {
  alignas(64) int32_t index[16];
  for (int t = 0; t < 16; ++t) index[t] = q4_lane_k(0, t);
  const __m512i order = _mm512_load_si512(index);
  for (int64_t i = 0; i < M * K; i += 16) _mm512_storeu_ps(xt + i, _mm512_permutexvar_ps(order, _mm512_loadu_ps(x + i)));
}
inline bvec bzero() { return _mm512_setzero_ps(); }
inline bvec bload(const float* p) { return _mm512_loadu_ps(p); }
inline bvec bfma(bvec a, bvec b, bvec c) { return _mm512_fmadd_ps(a, b, c); }
inline float bsum(const bvec* acc) { return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])); }

#elif defined(__AVX2__) && defined(__FMA__)
#define TREESPEC_BLOCK_AVX2 1
constexpr int PV = 4;
typedef __m256 bvec;

template <bool Q4>
inline void block_weights(const uint8_t* q, int64_t b, float d, float m, bvec w[PV]) {
  const __m256 vd = _mm256_set1_ps(d);
  if (Q4) {
    // bytes 0-7 and 8-15 widened to 32 bits straight from memory (one shuffle each); their low nibbles are
    // k = 0-7 and 8-15 of the block, their high nibbles k = 16-23 and 24-31
    const uint8_t* qb = q + 16 * b;
    const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb)));
    const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8)));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    const __m256 vm = _mm256_set1_ps(m);
    w[0] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_and_si256(first, mask)), vm);
    w[1] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_and_si256(second, mask)), vm);
    w[2] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4)), vm);
    w[3] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4)), vm);
  } else {
    const int8_t* s = reinterpret_cast<const int8_t*>(q) + 32 * b;
    for (int i = 0; i < 4; ++i) {
      const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 8 * i));
      w[i] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
    }
  }
}
inline bvec bzero() { return _mm256_setzero_ps(); }
inline bvec bload(const float* p) { return _mm256_loadu_ps(p); }
inline bvec bfma(bvec a, bvec b, bvec c) { return _mm256_fmadd_ps(a, b, c); }
inline float bsum(const bvec* acc) {
  const __m256 v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if defined(TREESPEC_BLOCK_AVX512) || defined(TREESPEC_BLOCK_AVX2)
constexpr int kLanes = 32 / PV;

constexpr int64_t kPrefetchBytes = 8192;

// This thread's buffer `which` of at least `floats` floats, 32-byte aligned (grown as needed, kept).
inline float* thread_buffer(int which, int64_t floats) {
  thread_local std::vector<float> buffers[2];
  std::vector<float>& buffer = buffers[which];
  if (static_cast<int64_t>(buffer.size()) < floats + 8) buffer.resize(floats + 8);
  const uintptr_t p = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<float*>((p + 31) & ~static_cast<uintptr_t>(31));
}

template <bool Half>
inline const void* offset(const void* s, int64_t i) {
  return static_cast<const char*>(s) + i * (Half ? 2 : 4);
}

// The block scales (d, and m for Q4_1) of a tile's C weight rows, as floats. Read one at a time (scale_at),
// except float16 scales in one-row tiles on AVX-512: there a scalar float16 conversion per block and weight
// row cost about as much as the block's own arithmetic, so 16 blocks' scales of every weight row are
// converted at once (vcvtph2ps) into a small buffer. Both give the same exact values.
template <int C, bool Q4, bool Half, bool Chunked>
struct TileScales {
  const void* d;
  const void* m;
  int64_t blocks;
  alignas(64) float dc[Chunked ? C : 1][16];
  alignas(64) float mc[Chunked && Q4 ? C : 1][16];

  // Called with b = 0, 1, 2, ... in order.
  inline void at(int64_t b, float ds[C], float ms[C]) {
#if defined(TREESPEC_BLOCK_AVX512)
    if constexpr (Chunked) {
      if ((b & 15) == 0) {
        const int64_t left = blocks - b;
        const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
        for (int c = 0; c < C; ++c) {
          const uint16_t* dh = static_cast<const uint16_t*>(d) + c * blocks + b;
          _mm512_store_ps(dc[c], _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, dh)));
          if (Q4) {
            const uint16_t* mh = static_cast<const uint16_t*>(m) + c * blocks + b;
            _mm512_store_ps(mc[Q4 ? c : 0], _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mh)));
          }
        }
      }
      for (int c = 0; c < C; ++c) {
        ds[c] = dc[c][b & 15];
        ms[c] = Q4 ? mc[Q4 ? c : 0][b & 15] : 0.f;
      }
      return;
    }
#endif
    for (int c = 0; c < C; ++c) {
      ds[c] = scale_at<Half>(offset<Half>(d, c * blocks), b);
      ms[c] = Q4 ? scale_at<Half>(offset<Half>(m, c * blocks), b) : 0.f;
    }
  }
};

// R rows of x against C weight rows n0 .. n0 + C - 1: out[r * ldo + c] for r < R, c < C.
template <int R, int C, bool Q4, bool Half>
inline void tile(const float* x, int64_t K, const uint8_t* q, const void* d, const void* m, float* out,
                 int64_t ldo) {
  const int64_t blocks = K / 32, row_bytes = Q4 ? K / 2 : K;
#if defined(TREESPEC_BLOCK_AVX512)
  constexpr bool chunked = Half && R == 1;
#else
  constexpr bool chunked = false;
#endif
  TileScales<C, Q4, Half, chunked> scales{d, m, blocks, {}, {}};
  bvec acc[R][C][PV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < PV; ++v) acc[r][c][v] = bzero();
  for (int64_t b = 0; b < blocks; ++b) {
    // the next tiles' quants, kPrefetchBytes ahead in the weight rows' contiguous stream (software
    // prefetch keeps more of DRAM's latency hidden than the hardware prefetchers do on these short runs)
    if ((b & 3) == 0)
      for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(q + c * row_bytes + (Q4 ? 16 : 32) * b) + kPrefetchBytes, _MM_HINT_T0);
    float ds[C], ms[C];
    scales.at(b, ds, ms);
#if defined(TREESPEC_BLOCK_AVX2)
    // One weight row's block at a time, used up before the next is built: with 16 registers, the 2 x 4
    // accumulators of a 1 x 2 tile beside both rows' decoded blocks spilled three accumulators to the stack
    // (a store and a reload on their FMA chains every block). x is read again per weight row (from L1).
    for (int c = 0; c < C; ++c) {
      bvec w[PV];
      block_weights<Q4>(q + c * row_bytes, b, ds[c], ms[c], w);
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * K + 32 * b;
        for (int v = 0; v < PV; ++v) acc[r][c][v] = bfma(bload(xb + kLanes * v), w[v], acc[r][c][v]);
      }
    }
#else
    bvec w[C][PV];
    for (int c = 0; c < C; ++c) block_weights<Q4>(q + c * row_bytes, b, ds[c], ms[c], w[c]);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * K + 32 * b;
      for (int v = 0; v < PV; ++v) {
        const bvec xv = bload(xb + kLanes * v);
        for (int c = 0; c < C; ++c) acc[r][c][v] = bfma(xv, w[c][v], acc[r][c][v]);
      }
    }
#endif
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = bsum(acc[r][c]);
}

// Weight rows per tile for a tile of R rows (the accumulators, weights and one x vector fit the registers).
template <int R>
constexpr int columns_for() {
#if defined(TREESPEC_BLOCK_AVX512)
  return R == 1 ? 4 : (R <= 3 ? 3 : 2);
#else
  return R == 1 ? 2 : 1;
#endif
}

template <int R, bool Q4, bool Half>
inline void row_block(const float* x, int64_t K, const uint8_t* q, const void* d, const void* m, float* out,
                      int64_t ldo, int64_t n0, int64_t n1) {
  constexpr int C = columns_for<R>();
  const int64_t blocks = K / 32, row_bytes = Q4 ? K / 2 : K;
  int64_t n = n0;
  for (; n + C <= n1; n += C)
    tile<R, C, Q4, Half>(x, K, q + n * row_bytes, offset<Half>(d, n * blocks), Q4 ? offset<Half>(m, n * blocks) : nullptr,
                         out + n, ldo);
  for (; n < n1; ++n)
    tile<R, 1, Q4, Half>(x, K, q + n * row_bytes, offset<Half>(d, n * blocks), Q4 ? offset<Half>(m, n * blocks) : nullptr,
                         out + n, ldo);
}

#if defined(TREESPEC_BLOCK_AVX512)
constexpr int kRows = 6;
#else
constexpr int kRows = 2;
#endif

#if defined(TREESPEC_BLOCK_AVX2)
// Three or more rows on AVX2 (a verified tree): tile() rebuilds every weight block in registers for only
// kRows = 2 rows (its accumulators fill the registers), so decoding, not arithmetic, bounds it. Instead:
// decode up to kDecodedFloats weights (whole weight rows) once into a float32 buffer (block_weights' vectors
// stored: the same values), then run every tile of R rows of x against them, C weight rows at a time.
// Accumulator v of an output is an independent FMA chain over the blocks, so a tile runs it as its own pass
// over the blocks (v = 0 .. PV - 1) with R * C accumulators + C weight vectors + one x vector in the 16 ymm
// registers, keeps the PV results of each output and adds them with bsum: each output gets exactly tile()'s
// operations in tile()'s order, bit for bit. The decoded weights and the tile's rows of x are laid out
// v-major (vector v of every block, then vector v + 1: element 32b + kLanes * v + l of a row at
// v * K / PV + kLanes * b + l), so each pass reads its R + C streams contiguously.
constexpr int kDecodedRows = 4;               // R: rows of x per tile
constexpr int kDecodedColumns = 3;            // C: weight rows per tile
constexpr int64_t kDecodedMinRows = 3;        // fewer rows: tile() is as fast (and one row is memory-bound)
constexpr int64_t kDecodedFloats = 1 << 16;   // decoded weights held at once (256 KiB: L2), at least C rows
constexpr int64_t kDecodedMaxK = 1 << 16;     // longer weight rows: tile() (smaller buffers)

// Weight row q (its d, m) decoded v-major into w[0, K).
template <bool Q4, bool Half>
inline void decode_row(int64_t K, const uint8_t* q, const void* d, const void* m, float* w) {
  const int64_t blocks = K / 32, stride = K / PV;
  for (int64_t b = 0; b < blocks; ++b) {
    if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + (Q4 ? 16 : 32) * b) + kPrefetchBytes, _MM_HINT_T0);
    bvec v[PV];
    block_weights<Q4>(q, b, scale_at<Half>(d, b), Q4 ? scale_at<Half>(m, b) : 0.f, v);
    for (int i = 0; i < PV; ++i) _mm256_store_ps(w + i * stride + kLanes * b, v[i]);
  }
}

// The M rows of x, each v-major, into xt.
inline void rows_v_major(const float* x, int64_t M, int64_t K, float* xt) {
  const int64_t blocks = K / 32, stride = K / PV;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < blocks; ++b)
      for (int i = 0; i < PV; ++i)
        _mm256_store_ps(xt + r * K + i * stride + kLanes * b, bload(x + r * K + 32 * b + kLanes * i));
}

// An aligned load the compiler keeps as its own instruction: one load per vector, not a load folded into
// every FMA that uses it (which would double the loads of the tile's loop).
inline bvec load_once(const float* p) {
  bvec v;
  __asm__("vmovaps %1, %0" : "=x"(v) : "m"(*reinterpret_cast<const __m256*>(p)));
  return v;
}

// R v-major rows xt against C decoded weight rows w: out[r * ldo + c] for r < R, c < C.
template <int R, int C>
inline void decoded_tile(const float* xt, int64_t K, const float* w, float* out, int64_t ldo) {
  const int64_t blocks = K / 32, stride = K / PV;
  bvec part[PV][R][C];
  for (int v = 0; v < PV; ++v) {
    bvec acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = bzero();
    const float* xv = xt + v * stride;
    const float* wv = w + v * stride;
    for (int64_t b = 0; b < blocks; ++b) {
      bvec wc[C];
      for (int c = 0; c < C; ++c) wc[c] = load_once(wv + c * K + kLanes * b);
      for (int r = 0; r < R; ++r) {
        const bvec xr = load_once(xv + r * K + kLanes * b);
        for (int c = 0; c < C; ++c) acc[r][c] = bfma(xr, wc[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) part[v][r][c] = acc[r][c];
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const bvec a[PV] = {part[0][r][c], part[1][r][c], part[2][r][c], part[3][r][c]};
      out[r * ldo + c] = bsum(a);
    }
}

// R v-major rows xt against the g decoded weight rows w: out[r * ldo + j] for r < R, j < g.
template <int R>
inline void decoded_rows(const float* xt, int64_t K, const float* w, int64_t g, float* out, int64_t ldo) {
  constexpr int C = kDecodedColumns;
  static_assert(C == 3, "the leftover weight rows below are 1 or 2");
  int64_t j = 0;
  for (; j + C <= g; j += C) decoded_tile<R, C>(xt, K, w + j * K, out + j, ldo);
  if (g - j == 2) decoded_tile<R, 2>(xt, K, w + j * K, out + j, ldo);
  if (g - j == 1) decoded_tile<R, 1>(xt, K, w + j * K, out + j, ldo);
}

template <bool Q4, bool Half>
void decoded_block_columns(const float* x, int64_t M, int64_t K, const uint8_t* q, const void* d, const void* m,
                           float* out, int64_t ldo, int64_t n0, int64_t n1) {
  constexpr int C = kDecodedColumns, R = kDecodedRows;
  static_assert(R == 4, "the leftover rows below are 1 to 3");
  const int64_t blocks = K / 32, row_bytes = Q4 ? K / 2 : K;
  const int64_t G = std::max<int64_t>(C, kDecodedFloats / K / C * C);  // weight rows decoded at once
  float* w = thread_buffer(0, std::min(G, n1 - n0) * K);
  float* xt = thread_buffer(1, R * K);
  for (int64_t n = n0; n < n1; n += G) {
    const int64_t g = std::min(G, n1 - n);
    for (int64_t j = n; j < n + g; ++j)
      decode_row<Q4, Half>(K, q + j * row_bytes, offset<Half>(d, j * blocks), Q4 ? offset<Half>(m, j * blocks) : nullptr,
                           w + (j - n) * K);
    for (int64_t r = 0; r < M; r += R) {
      const int64_t rows = std::min<int64_t>(R, M - r);
      rows_v_major(x + r * K, rows, K, xt);
      float* o = out + r * ldo + n;
      switch (rows) {
        case 1: decoded_rows<1>(xt, K, w, g, o, ldo); break;
        case 2: decoded_rows<2>(xt, K, w, g, o, ldo); break;
        case 3: decoded_rows<3>(xt, K, w, g, o, ldo); break;
        default: decoded_rows<R>(xt, K, w, g, o, ldo); break;
      }
    }
  }
}
#endif

template <bool Q4, bool Half>
void block_columns(const float* x, int64_t M, int64_t K, const uint8_t* q, const void* d, const void* m,
                   float* out, int64_t ldo, int64_t n0, int64_t n1) {
#if defined(TREESPEC_BLOCK_AVX2)
  if (M >= kDecodedMinRows && K <= kDecodedMaxK) {
    decoded_block_columns<Q4, Half>(x, M, K, q, d, m, out, ldo, n0, n1);
    return;
  }
#endif
#if defined(TREESPEC_BLOCK_AVX512)
  if (Q4) {  // x in the weights' lane order (block_weights)
    float* xt = thread_buffer(1, M * K);
    q4_lane_order(x, M, K, xt);
    x = xt;
  }
#endif
  int64_t r = 0;
  for (; r + kRows <= M; r += kRows) row_block<kRows, Q4, Half>(x + r * K, K, q, d, m, out + r * ldo, ldo, n0, n1);
  const float* xr = x + r * K;
  float* o = out + r * ldo;
  switch (M - r) {
    case 1: row_block<1, Q4, Half>(xr, K, q, d, m, o, ldo, n0, n1); break;
#if defined(TREESPEC_BLOCK_AVX512)
    case 2: row_block<2, Q4, Half>(xr, K, q, d, m, o, ldo, n0, n1); break;
    case 3: row_block<3, Q4, Half>(xr, K, q, d, m, o, ldo, n0, n1); break;
    case 4: row_block<4, Q4, Half>(xr, K, q, d, m, o, ldo, n0, n1); break;
    case 5: row_block<5, Q4, Half>(xr, K, q, d, m, o, ldo, n0, n1); break;
#endif
    default: break;
  }
}

#else  // scalar: the same weights, summed in k order

template <bool Q4, bool Half>
void block_columns(const float* x, int64_t M, int64_t K, const uint8_t* q, const void* d, const void* m,
                   float* out, int64_t ldo, int64_t n0, int64_t n1) {
  const int64_t blocks = K / 32, row_bytes = Q4 ? K / 2 : K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qrow = q + n * row_bytes;
    for (int64_t r = 0; r < M; ++r) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t b = n * blocks + k / 32, j = k % 32;
        float w;
        if (Q4) {
          const uint8_t byte = qrow[16 * (k / 32) + (j % 16)];
          w = __builtin_fmaf(scale_at<Half>(d, b), static_cast<float>(j < 16 ? (byte & 0x0F) : (byte >> 4)),
                             scale_at<Half>(m, b));
        } else {
          w = scale_at<Half>(d, b) * static_cast<float>(reinterpret_cast<const int8_t*>(qrow)[k]);
        }
        acc += x[r * K + k] * w;
      }
      out[r * ldo + n] = acc;
    }
  }
}
#endif

// Weight rows per parallel task: enough work per task to amortise its scheduling, and tasks enough to
// balance the threads.
constexpr int64_t kTaskColumns = 32;

template <bool Q4>
void quant_linear(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* d, const float* m,
                  float* out, int64_t N) {
  const int64_t tasks = (N + kTaskColumns - 1) / kTaskColumns;
  at::parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t)
      block_columns<Q4, false>(x, M, K, q, d, m, out, N, t * kTaskColumns, std::min(N, (t + 1) * kTaskColumns));
  });
}

}  // namespace

void linear_columns(const LinearWeights& w, const float* x, int64_t M, float* out, int64_t ldo, int64_t n0,
                    int64_t n1) {
  if (n0 >= n1 || M == 0) return;
  const uint8_t* q = static_cast<const uint8_t*>(w.w);
  const bool half = w.half_scales;
  switch (w.kind) {
    case WeightKind::kQ4_1:
      if (half)
        block_columns<true, true>(x, M, w.K, q, w.d, w.m, out, ldo, n0, n1);
      else
        block_columns<true, false>(x, M, w.K, q, w.d, w.m, out, ldo, n0, n1);
      break;
    case WeightKind::kQ8_0:
      if (half)
        block_columns<false, true>(x, M, w.K, q, w.d, nullptr, out, ldo, n0, n1);
      else
        block_columns<false, false>(x, M, w.K, q, w.d, nullptr, out, ldo, n0, n1);
      break;
    case WeightKind::kFloat32:
    case WeightKind::kBFloat16:
      exact_linear_columns(x, M, w.K, w.w, w.kind == WeightKind::kBFloat16, out, ldo, n0, n1);
      break;
  }
  if (w.bias != nullptr)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t n = n0; n < n1; ++n) out[r * ldo + n] += w.bias[n];
}

void q4_linear_cpu(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* d, const float* m,
                   float* out, int64_t N) {
  quant_linear<true>(x, M, K, q, d, m, out, N);
}

void q8_linear_cpu(const float* x, int64_t M, int64_t K, const int8_t* q, const float* d, float* out, int64_t N) {
  quant_linear<false>(x, M, K, reinterpret_cast<const uint8_t*>(q), d, nullptr, out, N);
}

}  // namespace treespec
