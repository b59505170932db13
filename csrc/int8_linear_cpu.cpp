// int8 numerics (int8_linear.h): activation quantization, the weight repacking and the integer kernels.
//
// Engines: AVX-512 VNNI (`vpdpbusd`: 64 unsigned-by-signed byte products summed into 16 int32 lanes per
// instruction; one lane per weight row of a 16-row group), AVX2 (`vpmaddubsw` + `vpmaddwd` on each half of a
// group, 8 lanes; Q8 weights through the sign trick, |q| * sign(x, q), so no 16-bit sum saturates) and the
// scalar reference. All compute each output with the same float operations in the same order (the integer
// sums are exact), so they agree bit for bit. A tile of R rows x one group unpacks each weight block once for
// its R rows.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "int8_linear.h"

namespace treespec {
namespace {

constexpr int64_t kGroup = 16;  // weight rows per group (one per int32 lane of a 512-bit vector)

// float16 bits of a float that holds a float16 value (exact; the block scales of a GGUF file)
uint16_t float_to_half(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const int exponent = static_cast<int>((bits >> 23) & 0xFFu) - 127 + 15;
  const uint32_t mantissa = bits & 0x7FFFFFu;
  if ((bits & 0x7FFFFFFFu) == 0) return static_cast<uint16_t>(sign);
  if (exponent >= 31) return static_cast<uint16_t>(sign | 0x7C00u | (mantissa ? 0x200u : 0u));
  if (exponent <= 0) {  // subnormal in float16
    const uint32_t m = (mantissa | 0x800000u) >> (14 - exponent);
    return static_cast<uint16_t>(sign | m);
  }
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exponent) << 10) | (mantissa >> 13));
}

uint16_t scale_bits(const void* s, bool half, int64_t i) {
  return half ? static_cast<const uint16_t*>(s)[i] : float_to_half(static_cast<const float*>(s)[i]);
}

// The weight q[n, k] of a GGUF-layout linear (Q4_1: [0, 15]; Q8_0: [-127, 127])
int quant_at(const LinearWeights& w, int64_t n, int64_t k) {
  if (w.kind == WeightKind::kQ4_1) {
    const uint8_t byte = static_cast<const uint8_t*>(w.w)[n * (w.K / 2) + 16 * (k / 32) + (k % 16)];
    return (k % 32) < 16 ? (byte & 0x0F) : (byte >> 4);
  }
  return static_cast<const int8_t*>(w.w)[n * w.K + k];
}

constexpr int64_t block_bytes(bool q4) { return q4 ? 256 : 512; }

// The integer sum of weight column c (of its group) of block (g, b) against 32 activations xq.
int32_t integer_sum(const Int8Weights& w, int64_t g, int64_t b, int c, const int8_t* xq, int32_t xsum) {
  const uint8_t* block = w.quants.data() + (g * w.blocks + b) * block_bytes(w.q4);
  int32_t isum = 0;
  if (w.q4) {
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 4; ++i) {
        const uint8_t byte = block[64 * j + 4 * c + i];
        isum += (byte & 0x0F) * xq[8 * j + i] + (byte >> 4) * xq[8 * j + 4 + i];
      }
    return isum;
  }
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 4; ++i) isum += block[64 * j + 4 * c + i] * xq[4 * j + i];
  return isum - 128 * xsum;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TREESPEC_INT8_VNNI 1

// R rows of x against the 16 weight rows of group g: out[r * ldo + c] for c < valid.
// R rows of x against the 16 * C weight rows of groups g .. g + C - 1: out[r * ldo + 16 c + l] for lanes l of
// group c that hold a row below N. Each broadcast of 4 activation bytes feeds C `vpdpbusd`.
template <int R, int C, bool Q4>
void tile(const Int8Weights& w, int64_t g, const QuantRows& x, int64_t r0, float* out, int64_t ldo) {
  const int64_t blocks = w.blocks;
  const uint8_t* quants = w.quants.data() + g * blocks * block_bytes(Q4);
  const uint16_t* d = w.d.data() + g * blocks * kGroup;
  const uint16_t* mins = Q4 ? w.m.data() + g * blocks * kGroup : nullptr;
  const int64_t group_bytes = blocks * block_bytes(Q4), group_scales = blocks * kGroup;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 wd[C], wm[C];
    __m512i wq[C][8];
    for (int c = 0; c < C; ++c) {
      const uint8_t* block = quants + c * group_bytes + b * block_bytes(Q4);
      _mm_prefetch(reinterpret_cast<const char*>(block) + 4096, _MM_HINT_T0);
      wd[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + c * group_scales + b * kGroup)));
      if constexpr (Q4) {
        wm[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + c * group_scales + b * kGroup)));
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_loadu_si512(block + 64 * j);
          wq[c][2 * j] = _mm512_and_si512(v, low);
          wq[c][2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
      } else {
        for (int j = 0; j < 8; ++j) wq[c][j] = _mm512_loadu_si512(block + 64 * j);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int32_t* x4 = reinterpret_cast<const int32_t*>(x.q.data() + row * x.K + 32 * b);
      // two chains per group (even and odd 4-byte steps) where few rows leave the latency exposed; the
      // integer sums are exact, so their order changes nothing
      constexpr int chains = R <= 2 ? 2 : 1;
      __m512i isum[C][chains];
      for (int c = 0; c < C; ++c)
        for (int h = 0; h < chains; ++h) isum[c][h] = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        const __m512i xv = _mm512_set1_epi32(x4[j]);
        for (int c = 0; c < C; ++c) isum[c][j % chains] = _mm512_dpbusd_epi32(isum[c][j % chains], wq[c][j], xv);
      }
      const __m512 xd = _mm512_set1_ps(x.d[row * x.blocks + b]);
      for (int c = 0; c < C; ++c) {
        __m512i total = isum[c][0];
        if constexpr (chains == 2) total = _mm512_add_epi32(total, isum[c][1]);
        if constexpr (!Q4) total = _mm512_sub_epi32(total, _mm512_set1_epi32(128 * x.sum[row * x.blocks + b]));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(xd, wd[c]), acc[r][c]);
        if constexpr (Q4) acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(x.dsum[row * x.blocks + b]), wm[c], acc[r][c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t first = (g + c) * kGroup;
    const int valid = static_cast<int>(std::min<int64_t>(kGroup, w.N - first));
    const __mmask16 mask = valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    __m512 bias = _mm512_setzero_ps();
    if (w.bias != nullptr) bias = _mm512_maskz_loadu_ps(mask, w.bias + first);
    for (int r = 0; r < R; ++r) {
      __m512 v = acc[r][c];
      if (w.bias != nullptr) v = _mm512_add_ps(v, bias);
      _mm512_mask_storeu_ps(out + r * ldo + c * kGroup, mask, v);
    }
  }
}

// Rows in tiles of kRows (then the rest) against groups C at a time.
template <int C, bool Q4>
void rows_vnni(const Int8Weights& w, int64_t g, const QuantRows& x, int64_t M, float* out, int64_t ldo) {
  constexpr int kRows = C == 1 ? 6 : 4;
  int64_t r = 0;
  for (; r + kRows <= M; r += kRows) tile<kRows, C, Q4>(w, g, x, r, out + r * ldo, ldo);
  float* o = out + r * ldo;
  switch (M - r) {
    case 1: tile<1, C, Q4>(w, g, x, r, o, ldo); break;
    case 2: tile<2, C, Q4>(w, g, x, r, o, ldo); break;
    case 3: tile<3, C, Q4>(w, g, x, r, o, ldo); break;
    case 4: tile<4, C, Q4>(w, g, x, r, o, ldo); break;
    case 5: tile<5, C, Q4>(w, g, x, r, o, ldo); break;
    default: break;
  }
}

// Columns [n0, n1) (n0 a multiple of 16; the last group's lanes past n1 are stored only below N, so n1 is a
// multiple of 16 or N).
template <bool Q4>
void columns_vnni(const Int8Weights& w, const QuantRows& x, int64_t M, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  int64_t g = n0 / kGroup;
  const int64_t end = (n1 + kGroup - 1) / kGroup;
  for (; g + 2 <= end; g += 2) rows_vnni<2, Q4>(w, g, x, M, out + g * kGroup, ldo);
  if (g < end) rows_vnni<1, Q4>(w, g, x, M, out + g * kGroup, ldo);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TREESPEC_INT8_AVX2 1

// R rows of x against weight rows 8 * half .. 8 * half + 7 of group g: out[r * ldo + c] for c < valid.
template <int R, bool Q4>
void tile_avx2(const Int8Weights& w, int64_t g, int half, const QuantRows& x, int64_t r0, float* out, int64_t ldo,
               int valid) {
  const int64_t blocks = w.blocks;
  const uint8_t* quants = w.quants.data() + g * blocks * block_bytes(Q4) + 32 * half;
  const uint16_t* d = w.d.data() + g * blocks * kGroup + 8 * half;
  const uint16_t* mins = Q4 ? w.m.data() + g * blocks * kGroup + 8 * half : nullptr;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = quants + b * block_bytes(Q4);
    const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b * kGroup)));
    __m256 wm = _mm256_setzero_ps();
    __m256i wq[8];
    if constexpr (Q4) {
      wm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + b * kGroup)));
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j));
        wq[2 * j] = _mm256_and_si256(v, low);
        wq[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
    } else {  // q = stored byte - 128, as a signed byte
      for (int j = 0; j < 8; ++j)
        wq[j] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j)), flip);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int32_t* x4 = reinterpret_cast<const int32_t*>(x.q.data() + row * x.K + 32 * b);
      __m256i isum = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i xv = _mm256_set1_epi32(x4[j]);
        const __m256i pairs = Q4 ? _mm256_maddubs_epi16(wq[j], xv)
                                 : _mm256_maddubs_epi16(_mm256_abs_epi8(wq[j]), _mm256_sign_epi8(xv, wq[j]));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, ones));
      }
      const __m256 s = _mm256_mul_ps(_mm256_set1_ps(x.d[row * x.blocks + b]), wd);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), s, acc[r]);
      if constexpr (Q4) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x.dsum[row * x.blocks + b]), wm, acc[r]);
    }
  }
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256 bias = _mm256_setzero_ps();
  if (w.bias != nullptr) bias = _mm256_maskload_ps(w.bias + g * kGroup + 8 * half, mask);
  for (int r = 0; r < R; ++r) {
    __m256 v = acc[r];
    if (w.bias != nullptr) v = _mm256_add_ps(v, bias);
    _mm256_maskstore_ps(out + r * ldo, mask, v);
  }
}

constexpr int kRowsAvx2 = 4;

template <bool Q4>
void columns_avx2(const Int8Weights& w, const QuantRows& x, int64_t M, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += 8) {
    const int64_t g = n / kGroup;
    const int half = static_cast<int>((n % kGroup) / 8);
    const int valid = static_cast<int>(std::min<int64_t>(8, n1 - n));
    int64_t r = 0;
    for (; r + kRowsAvx2 <= M; r += kRowsAvx2) tile_avx2<kRowsAvx2, Q4>(w, g, half, x, r, out + r * ldo + n, ldo, valid);
    float* o = out + r * ldo + n;
    switch (M - r) {
      case 1: tile_avx2<1, Q4>(w, g, half, x, r, o, ldo, valid); break;
      case 2: tile_avx2<2, Q4>(w, g, half, x, r, o, ldo, valid); break;
      case 3: tile_avx2<3, Q4>(w, g, half, x, r, o, ldo, valid); break;
      default: break;
    }
  }
}
#endif

}  // namespace

Int8Weights repack_int8(const LinearWeights& w) {
  Int8Weights out;
  out.q4 = w.kind == WeightKind::kQ4_1;
  out.N = w.N;
  out.K = w.K;
  out.groups = (w.N + kGroup - 1) / kGroup;
  out.blocks = w.K / 32;
  out.bias = w.bias;
  const int64_t G = out.groups, B = out.blocks, bytes = block_bytes(out.q4);
  out.quants.assign(G * B * bytes, out.q4 ? 0 : 128);  // padding rows: q = 0
  out.d.assign(G * B * kGroup, 0);
  if (out.q4) out.m.assign(G * B * kGroup, 0);
  for (int64_t n = 0; n < w.N; ++n) {
    const int64_t g = n / kGroup;
    const int c = static_cast<int>(n % kGroup);
    for (int64_t b = 0; b < B; ++b) {
      uint8_t* block = out.quants.data() + (g * B + b) * bytes;
      out.d[(g * B + b) * kGroup + c] = scale_bits(w.d, w.half_scales, n * B + b);
      if (out.q4) {
        out.m[(g * B + b) * kGroup + c] = scale_bits(w.m, w.half_scales, n * B + b);
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 4; ++i)
            block[64 * j + 4 * c + i] = static_cast<uint8_t>(quant_at(w, n, 32 * b + 8 * j + i) |
                                                             (quant_at(w, n, 32 * b + 8 * j + 4 + i) << 4));
      } else {
        for (int j = 0; j < 8; ++j)
          for (int i = 0; i < 4; ++i) block[64 * j + 4 * c + i] = static_cast<uint8_t>(quant_at(w, n, 32 * b + 4 * j + i) + 128);
      }
    }
  }
  return out;
}

void quantize_blocks(const float* x, QuantRows& rows, int64_t r, int64_t b0, int64_t b1) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // the scalar loop below, 16 lanes at a time: the same multiplications and round-to-nearest-even
  // conversions, so the same bytes
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t b = b0; b < b1; ++b) {
    const float* xb = x + 32 * b;
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
    const float d = amax / 127.0f;
    const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    const __m512i q0 = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_mul_ps(v0, inverse))));
    const __m512i q1 = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_mul_ps(v1, inverse))));
    int8_t* q = rows.q.data() + r * rows.K + 32 * b;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    rows.d[r * rows.blocks + b] = d;
    rows.sum[r * rows.blocks + b] = sum;
    rows.dsum[r * rows.blocks + b] = d * static_cast<float>(sum);
  }
#else
  for (int64_t b = b0; b < b1; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.0f;
    for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float d = amax / 127.0f;
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    int8_t* q = rows.q.data() + r * rows.K + 32 * b;
    int32_t sum = 0;
    for (int k = 0; k < 32; ++k) {
      const float v = std::nearbyint(xb[k] * inverse);
      q[k] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
      sum += q[k];
    }
    rows.d[r * rows.blocks + b] = d;
    rows.sum[r * rows.blocks + b] = sum;
    rows.dsum[r * rows.blocks + b] = d * static_cast<float>(sum);
  }
#endif
}

void int8_columns_reference(const Int8Weights& w, const QuantRows& x, int64_t M, float* out, int64_t ldo, int64_t n0,
                            int64_t n1) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t g = n / kGroup;
      const int c = static_cast<int>(n % kGroup);
      float acc = 0.0f;
      for (int64_t b = 0; b < w.blocks; ++b) {
        const int64_t xb = r * x.blocks + b, wb = (g * w.blocks + b) * kGroup + c;
        const int32_t isum = integer_sum(w, g, b, c, x.q.data() + r * x.K + 32 * b, x.sum[xb]);
        const float s = x.d[xb] * half_to_float(w.d[wb]);
        acc = std::fma(static_cast<float>(isum), s, acc);
        if (w.q4) acc = std::fma(x.dsum[xb], half_to_float(w.m[wb]), acc);
      }
      out[r * ldo + n] = w.bias != nullptr ? acc + w.bias[n] : acc;
    }
}

std::vector<Int8Engine> int8_engines() {
  std::vector<Int8Engine> engines = {Int8Engine::kReference};
#if defined(TREESPEC_INT8_AVX2)
  engines.push_back(Int8Engine::kAvx2);
#endif
#if defined(TREESPEC_INT8_VNNI)
  engines.push_back(Int8Engine::kVnni);
#endif
  return engines;
}

void int8_columns(const Int8Weights& w, const QuantRows& x, int64_t M, float* out, int64_t ldo, int64_t n0, int64_t n1,
                  Int8Engine engine) {
  if (n0 >= n1 || M == 0) return;
  if (engine == Int8Engine::kAuto) engine = int8_engines().back();
  switch (engine) {
#if defined(TREESPEC_INT8_VNNI)
    case Int8Engine::kVnni:
      if (w.q4)
        columns_vnni<true>(w, x, M, out, ldo, n0, n1);
      else
        columns_vnni<false>(w, x, M, out, ldo, n0, n1);
      return;
#endif
#if defined(TREESPEC_INT8_AVX2)
    case Int8Engine::kAvx2:
      if (w.q4)
        columns_avx2<true>(w, x, M, out, ldo, n0, n1);
      else
        columns_avx2<false>(w, x, M, out, ldo, n0, n1);
      return;
#endif
    default: int8_columns_reference(w, x, M, out, ldo, n0, n1);
  }
}

}  // namespace treespec
