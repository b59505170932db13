// Portable fp32 SIMD helpers shared by the CPU kernels: GCC/Clang vector extensions sized for AVX-512
// when the compiler targets it (the JIT build uses -march=native) and 256-bit otherwise, the exp2 of
// the online softmax, and bf16 <-> fp32 conversions. Every function here is elementwise (a lane's result
// never depends on the other lanes), which the row-invariant kernels rely on.
#pragma once

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
  int vector_of_lane[VL];  // output lane l holds the sum of input vector vector_of_lane[l]
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
    vf probe[VL];  // vector k holds k in every lane, so its sum is VL * k
    for (int k = 0; k < VL; ++k) probe[k] = splat(static_cast<float>(k));
    const vf sums = lane_sums_run(p, probe);
    for (int l = 0; l < VL; ++l) p.vector_of_lane[l] = static_cast<int>(sums[l]) / VL;
    return p;
  }();
  return plan;
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

// dst[0, n) = float(src[0, n)) for bf16 src
inline void bf16_row_to_float(const uint16_t* src, float* dst, int n) {
  int d = 0;
  for (; d + VL <= n; d += VL) {
    vu16 h;
    std::memcpy(&h, src + d, sizeof(h));
    const vu32 u = __builtin_convertvector(h, vu32) << 16;
    std::memcpy(dst + d, &u, sizeof(u));
  }
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
