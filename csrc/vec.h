// Portable fp32 SIMD helpers shared by the CPU kernels: GCC/Clang vector extensions sized for AVX-512
// when the compiler targets it (the JIT build uses -march=native) and 256-bit otherwise, the exp2 of
// the online softmax, and bf16 <-> fp32 conversions. Every function here is elementwise (a lane's result
// never depends on the other lanes), which the row-invariant kernels rely on.
#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace treespec {
namespace {

#if defined(__AVX512F__)
#define TREESPEC_VL 16
#else
#define TREESPEC_VL 8
#endif

constexpr int VL = TREESPEC_VL;          // fp32 lanes per vector
typedef float vf __attribute__((vector_size(TREESPEC_VL * 4)));
typedef int32_t vi __attribute__((vector_size(TREESPEC_VL * 4)));
typedef uint32_t vu32 __attribute__((vector_size(TREESPEC_VL * 4)));
typedef uint16_t vu16 __attribute__((vector_size(TREESPEC_VL * 2)));

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf splat(float x) { return vf{} + x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// a * b + c rounded once (per lane), whatever contraction the compiler would choose. The row-invariant
// kernels spell their multiply-adds this way: left to the compiler, `acc += a * b` was fused in one loop
// and not in another (gcc's Zen tuning keeps FMAs out of loop-carried chains), so a row's bits could
// depend on the tile it was computed in.
inline vf fmadd(vf a, vf b, vf c) {
#if TREESPEC_VL == 16
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif (defined(__x86_64__) || defined(__i386__)) && !defined(__FMA__)
  return a * b + c;  // no FMA instruction to fuse into: two roundings, whatever the compiler does
#else
  vf r;
  for (int i = 0; i < VL; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
#endif
}

// The lanes of v added in one fixed pairwise order (half + half, repeatedly).
inline float lane_sum(vf v) {
  float s[VL];
  std::memcpy(s, &v, sizeof(v));
  for (int w = VL / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) s[i] += s[i + w];
  return s[0];
}

#if defined(__GNUC__) && !defined(__clang__)
#define TREESPEC_LANE_SUMS 1
constexpr int kLaneLevels = TREESPEC_VL == 16 ? 4 : 3;

// lane_sum of VL vectors at once (a transposing reduction network): every output lane is one vector's
// lane_sum, computed with exactly lane_sum's additions. Level h folds each group of 2h lanes into h lanes
// (lane i + lane i + h), taking the groups alternately from two vectors.
struct LaneSums {
  vi lo[kLaneLevels], hi[kLaneLevels];
};

inline vf lane_sums_run(const LaneSums& plan, vf* v) {  // v: VL vectors, overwritten
  int count = VL, level = 0;
  for (int h = VL / 2; h >= 1; h /= 2, ++level, count /= 2)
    for (int j = 0; j < count / 2; ++j)
      v[j] = __builtin_shuffle(v[2 * j], v[2 * j + 1], plan.lo[level]) +
             __builtin_shuffle(v[2 * j], v[2 * j + 1], plan.hi[level]);
  return v[0];
}

inline const LaneSums& lane_sums_plan() {
  static const LaneSums plan = [] {
    LaneSums p{};
    int level = 0;
    for (int h = VL / 2; h >= 1; h /= 2, ++level)
      for (int j = 0; j < VL / h; ++j)
        for (int i = 0; i < h; ++i) {
          const int source = (j % 2) * VL + (j / 2) * 2 * h + i;  // group j / 2 of vector j % 2
          p.lo[level][j * h + i] = source;
          p.hi[level][j * h + i] = source + h;
        }
    return p;
  }();
  return plan;
}
#endif

#if defined(__AVX512F__) && TREESPEC_LANE_SUMS
#define TREESPEC_LANE_SUMS16 1
// lane_sum of 16 vectors at once with the cheapest shuffles AVX-512 has for each level (256-bit halves,
// 128-bit lanes, then within 128-bit lanes): the same additions as lane_sum (lanes i and i + 8, then of
// those i and i + 4, i and i + 2, i and i + 1), each done in whichever lane the shuffles put it, so every
// output equals lane_sum of its vector bit for bit (which vector each output lane holds: lane_sums_vector).
inline vf lane_sums16(const vf* v) {
  __m512 x[8], y[4], z[2];
  for (int j = 0; j < 8; ++j) {  // [a.lo | b.lo] + [a.hi | b.hi] (256-bit halves): a's 8 sums, then b's
    const __m512 a = reinterpret_cast<const __m512*>(v)[2 * j], b = reinterpret_cast<const __m512*>(v)[2 * j + 1];
    x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int j = 0; j < 4; ++j)  // 128-bit lanes 0 + 1 and 2 + 3 of two vectors: 4 sums of each of 4 inputs
    y[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], 0xDD));
  for (int j = 0; j < 2; ++j) {  // within 128-bit lanes: pairs (0, 2), (1, 3)
    const __m512d a = _mm512_castps_pd(y[2 * j]), b = _mm512_castps_pd(y[2 * j + 1]);
    z[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 out = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
  vf r;
  std::memcpy(&r, &out, sizeof(r));
  return r;
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && TREESPEC_LANE_SUMS
#define TREESPEC_LANE_SUMS8 1
// lane_sum of 8 vectors at once with fixed AVX2 shuffles (128-bit halves, then within 128-bit lanes): the
// same additions as lane_sum (lanes i and i + 4, then of those i and i + 2, then i and i + 1), so every
// output equals lane_sum of its vector bit for bit (which vector each output lane holds: lane_sums_vector).
inline vf lane_sums8(const vf* v) {
  __m256 x[4], y[2];
  for (int j = 0; j < 4; ++j) {  // [a.lo + a.hi | b.lo + b.hi]: 4 partial sums of a, then of b
    const __m256 a = reinterpret_cast<const __m256*>(v)[2 * j], b = reinterpret_cast<const __m256*>(v)[2 * j + 1];
    x[j] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  for (int j = 0; j < 2; ++j)  // within 128-bit lanes: partials (0, 2), (1, 3) of two vectors
    y[j] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * j], x[2 * j + 1], 0x44), _mm256_shuffle_ps(x[2 * j], x[2 * j + 1], 0xEE));
  const __m256 out = _mm256_add_ps(_mm256_shuffle_ps(y[0], y[1], 0x88), _mm256_shuffle_ps(y[0], y[1], 0xDD));
  vf r;
  std::memcpy(&r, &out, sizeof(r));
  return r;
}
#endif

#if TREESPEC_LANE_SUMS
// lane_sum of VL vectors at once (v is overwritten) through the network this build has: fixed shuffles on
// AVX-512 and AVX2, the run-time plan otherwise. Output lane l holds the sum of vector lane_sums_vector()[l].
inline vf lane_sums(vf* v) {
#if TREESPEC_LANE_SUMS16
  return lane_sums16(v);
#elif TREESPEC_LANE_SUMS8
  return lane_sums8(v);
#else
  return lane_sums_run(lane_sums_plan(), v);
#endif
}

inline const int* lane_sums_vector() {
  static const struct Map {
    int lane[VL];
    Map() {
      vf probe[VL];  // vector k holds k in every lane, so its sum is VL * k
      for (int k = 0; k < VL; ++k) probe[k] = splat(static_cast<float>(k));
      const vf sums = lane_sums(probe);
      for (int l = 0; l < VL; ++l) lane[l] = static_cast<int>(sums[l]) / VL;
    }
  } map;
  return map.lane;
}
#endif

// 2^x for x <= 0 (and -inf -> 0): round-to-nearest range reduction and a degree-6 polynomial on
// [-0.5, 0.5] (max relative error 2e-9 before fp32 rounding).
inline vf exp2v(vf x) {
  const vf lo = splat(-126.0f);
  const vi tiny = x < lo;
  x = x < lo ? lo : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf r = (x + magic) - magic;
  const vf f = x - r;
  vf p = splat(1.5347281358220062e-4f);
  p = p * f + 1.3399943687392398e-3f;
  p = p * f + 9.618483499933144e-3f;
  p = p * f + 5.550328738068315e-2f;
  p = p * f + 2.402264694096416e-1f;
  p = p * f + 6.931472057614463e-1f;
  p = p * f + 1.0000000005474108f;
  const vi e = __builtin_convertvector(r, vi);
  const vi bits = (e + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const vf out = p * scale;
  return tiny ? splat(0.0f) : out;
}

// silu(g) = g / (1 + e^-g) per lane, with t = e^-|g| from exp2v: g / (1 + t) for g >= 0, g t / (1 + t) below
// (no overflow either way).
inline vf silu(vf g) {
  const vf zero = splat(0.0f);
  const vf t = exp2v((g < zero ? zero - g : g) * splat(-1.4426950408889634f));  // e^-|g|
  return (g < zero ? g * t : g) / (splat(1.0f) + t);
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// The VL floats of the bf16 values p[0, VL) (each widened exactly: its 16 bits become the high half).
// One widening load and a shift: gcc built the vector-extension form from two half-width widenings, a
// byte shift and an insert (4 shuffles per vector), which bound bf16 weight streams on a Zen 3.
inline vf widen_bf16(const uint16_t* p) {
  vf f;
#if TREESPEC_VL == 16
  const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  std::memcpy(&f, &u, sizeof(f));
#elif defined(__AVX2__)
  const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  std::memcpy(&f, &u, sizeof(f));
#else
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  const vu32 u = __builtin_convertvector(h, vu32) << 16;
  std::memcpy(&f, &u, sizeof(f));
#endif
  return f;
}

// The VL floats at p, float32 or bf16 (widened exactly): what the row-invariant kernels read of either dtype.
inline vf load_floats(const float* p) { return loadv(p); }
inline vf load_floats(const uint16_t* p) { return widen_bf16(p); }

// dst[0, n) = float(src[0, n)) for bf16 src
inline void bf16_row_to_float(const uint16_t* src, float* dst, int n) {
  int d = 0;
  for (; d + VL <= n; d += VL) storev(dst + d, widen_bf16(src + d));
  for (; d < n; ++d) dst[d] = bf16_to_float(src[d]);
}

template <typename T>
inline float to_float(T x);
template <>
inline float to_float<float>(float x) {
  return x;
}
template <>
inline float to_float<uint16_t>(uint16_t x) {
  return bf16_to_float(x);
}
template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) {
  return x;
}
template <>
inline uint16_t from_float<uint16_t>(float x) {
  return float_to_bf16(x);
}

}  // namespace
}  // namespace treespec
