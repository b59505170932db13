// int8 numerics (int8_linear.h): activation quantization, the weight repacking and the integer kernels.
//
// Engines: AVX-512 VNNI (`vpdpbusd`: 64 unsigned-by-signed byte products summed into 16 int32 lanes per
// instruction; one lane per weight row of a 16-row group), AVX2 (`vpmaddubsw` on each quarter of a panel,
// 8 lanes; a panel's four quarters in one pass over its records: Q4_1 sums a block's 16-bit pair sums and
// widens them once with `vpmaddwd`; Q8 weights go through the sign trick, |q| * sign(x, q), so no 16-bit
// sum saturates, and widen every pair sum; from 2 rows a group of 16 weight rows at a time, Q8 split into
// nibbles) and the scalar
// reference. All compute each output with the same float operations in the same order (the integer sums
// are exact), so they agree bit for bit. The VNNI tile is R rows x one panel of 32 weight rows: each
// weight chunk is loaded (and unpacked) once for its R rows.
//
// What bounds the VNNI kernel on Zen 4 (measured): `vpdpbusd`, `vmulps` and `vfmadd` share the same two
// pipes (one 512-bit op per cycle in all), while the int->float conversion, loads, broadcasts and the
// nibble unpack go elsewhere. Per (row, group of 16, block of 32) the defined numerics take 8 `vpdpbusd`
// plus one product xd * d and one (Q8) or two (Q4_1) FMAs: at best 8 / 10 (Q8) and 8 / 11 (Q4_1) of the
// `vpdpbusd` peak, 183 and 167 G products/s per core at 3.67 GHz.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include <sys/mman.h>

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

// The integer sum of weight column c (of its group) of block (g, b) against 32 activations xq.
int32_t integer_sum(const Int8Weights& w, int64_t g, int64_t b, int c, const int8_t* xq, int32_t xsum) {
  const uint8_t* block = w.quants(g, b);
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

// Columns [n0, n1) of M rows as the SIMD engines compute them: every panel p the columns touch (its lanes
// [lo, hi) stored; the others computed, not stored), its M rows in ceil(M / max_rows) tiles of as equal
// sizes as can be (8 rows at 6 a tile: 4 + 4): tile(p, lo, hi, r0, rows, t, tiles) for rows r0.. of tile t.
template <class Tile>
void for_panel_tiles(int64_t M, int64_t n0, int64_t n1, int64_t max_rows, Tile tile) {
  constexpr int64_t P = Int8Weights::kPanel;
  const int64_t tiles = (M + max_rows - 1) / max_rows;
  for (int64_t p = n0 / P; p < (n1 + P - 1) / P; ++p) {
    const int lo = static_cast<int>(std::max<int64_t>(n0 - p * P, 0));
    const int hi = static_cast<int>(std::min<int64_t>(n1 - p * P, P));
    for (int64_t t = 0, r = 0; t < tiles; ++t) {
      const int64_t rows = (M - r + tiles - t - 1) / (tiles - t);
      tile(p, lo, hi, r, rows, t, tiles);
      r += rows;
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TREESPEC_INT8_VNNI 1

// Software prefetch of the weight stream (into L2). The records of a task's columns are one sequential run.
// Measured on a Zen 4 EPYC, weights from DRAM, old and new alternated in one process:
// - one row (memory-bound): Q8 (the lm_head) streams fastest with 2 KB ahead of the loads and Q4_1 with
//   none (the hardware prefetcher follows it alone; 1-8 KB ahead cost 5-15%, one thread).
// - several rows compute long enough per record that the hardware prefetcher falls behind: a panel's first
//   row tile keeps 4 KB of the stream in flight ahead of its loads (its other tiles find the panel in L1 /
//   L2). A step's Q4_1 linears (2 threads, tasks as the native step's) took 0.67-0.94x the time at 2-6 rows
//   (one tile; the more rows, the more it saves) than with the hardware prefetcher alone, 0.80-0.90x at 7-16
//   rows (several tiles) than when each tile asked for a share of the next panel; the lm_head 0.84-0.95x at
//   2-6 rows (benchmarks/log/2026-12-07-c-zen4-int8-prefetch.md).
// - Q8 in several tiles (the lm_head from 7 rows) keeps asking for the next panel while this one computes,
//   each tile a share of its lines: streaming ahead cost it 1.09-1.16x at 7-12 rows.
template <int R, bool Q4>
constexpr int64_t kAhead = R > 1 ? 4096 : (Q4 ? 0 : 2048);

struct Prefetch {
  const uint8_t* end = nullptr;   // nothing at or past it is asked for
  const uint8_t* next = nullptr;  // Q8 in several tiles: the next panel's first record (else: stream ahead)
  int part = 0, parts = 1;        // ... this tile's share of each record's lines: [lines * part / parts, ...)
};

inline void prefetch_lines(const uint8_t* from, const uint8_t* to, const uint8_t* end) {
  if (to > end) to = end;
  for (const uint8_t* p = from; p < to; p += 64) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
}

// R rows of x (from r0) against the 32 weight rows of panel p: out[r * ldo + l] for the lanes l in [lo, hi)
// (columns 32p + l below N). Per block: the 32 weight rows' 8 (Q8) or 4 (Q4_1, two nibbles each) 64-byte chunks per group
// are loaded once and each feeds R `vpdpbusd` (one per row: the row's 4 activation bytes broadcast); every
// (row, group) keeps its integer sum in its own registers (CH chains where few rows leave the latency
// exposed; the sums are exact, so their split changes nothing), then the block's float step:
//   acc = fma(float(isum), xd * d, acc)  (+ fma(xd * xsum, m, acc) for Q4_1)
template <int R, bool Q4>
void panel_tile(const Int8Weights& w, int64_t p, const QuantRows& x, int64_t r0, float* out, int64_t ldo, int lo,
                int hi, const Prefetch& pf) {
  constexpr int CH = R <= 2 ? 2 : 1;
  constexpr int64_t kQuant = Q4 ? 256 : 512;  // quant bytes of one group in a record
  const int64_t blocks = w.blocks, record = w.record;
  const uint8_t* rec = w.at(p, 0);
  const int8_t* xrow[R];
  const float* xd[R];
  const float* xdsum[R];
  const int32_t* xsum[R];
  for (int r = 0; r < R; ++r) {
    xrow[r] = x.q.data() + (r0 + r) * x.K;
    xd[r] = x.d.data() + (r0 + r) * x.blocks;
    xdsum[r] = x.dsum.data() + (r0 + r) * x.blocks;
    xsum[r] = x.sum.data() + (r0 + r) * x.blocks;
  }
  constexpr int64_t kBytes = kAhead<R, Q4>;
  const bool ahead = pf.next == nullptr && pf.part == 0 && kBytes > 0;
  if (ahead) prefetch_lines(rec, rec + kBytes, pf.end);
  const int64_t lines = record / 64, share0 = lines * pf.part / pf.parts, share1 = lines * (pf.part + 1) / pf.parts;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b, rec += record) {
    if (ahead) prefetch_lines(rec + kBytes, rec + kBytes + record, pf.end);
    if (pf.next != nullptr)
      prefetch_lines(pf.next + b * record + 64 * share0, pf.next + b * record + 64 * share1, pf.end);
    __m512i isum[R][2][CH];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 2; ++c)
        for (int h = 0; h < CH; ++h) isum[r][c][h] = _mm512_setzero_si512();
    if constexpr (Q4) {
      // chunk j of a group: low nibbles k = 8j .. 8j + 3, high nibbles k = 8j + 4 .. 8j + 7
      for (int j = 0; j < 4; ++j) {
        const __m512i v0 = _mm512_load_si512(rec + 64 * j), v1 = _mm512_load_si512(rec + kQuant + 64 * j);
        const __m512i lo0 = _mm512_and_si512(v0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
        const __m512i lo1 = _mm512_and_si512(v1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
        for (int r = 0; r < R; ++r) {
          const int32_t* x4 = reinterpret_cast<const int32_t*>(xrow[r] + 32 * b);
          const __m512i xa = _mm512_set1_epi32(x4[2 * j]), xb = _mm512_set1_epi32(x4[2 * j + 1]);
          isum[r][0][0] = _mm512_dpbusd_epi32(isum[r][0][0], lo0, xa);
          isum[r][1][0] = _mm512_dpbusd_epi32(isum[r][1][0], lo1, xa);
          isum[r][0][CH - 1] = _mm512_dpbusd_epi32(isum[r][0][CH - 1], hi0, xb);
          isum[r][1][CH - 1] = _mm512_dpbusd_epi32(isum[r][1][CH - 1], hi1, xb);
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        const __m512i v0 = _mm512_load_si512(rec + 64 * j), v1 = _mm512_load_si512(rec + kQuant + 64 * j);
        for (int r = 0; r < R; ++r) {
          const __m512i xv = _mm512_set1_epi32(reinterpret_cast<const int32_t*>(xrow[r] + 32 * b)[j]);
          isum[r][0][j % CH] = _mm512_dpbusd_epi32(isum[r][0][j % CH], v0, xv);
          isum[r][1][j % CH] = _mm512_dpbusd_epi32(isum[r][1][j % CH], v1, xv);
        }
      }
    }
    // the block's float step, in the defined order
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(rec + 2 * kQuant);
    __m512 wd[2], wm[2];
    for (int c = 0; c < 2; ++c) {
      wd[c] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(scales + 16 * c)));
      if constexpr (Q4) wm[c] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(scales + 32 + 16 * c)));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_set1_ps(xd[r][b]);
      for (int c = 0; c < 2; ++c) {
        __m512i total = isum[r][c][0];
        if constexpr (CH == 2) total = _mm512_add_epi32(total, isum[r][c][1]);
        if constexpr (!Q4) total = _mm512_sub_epi32(total, _mm512_set1_epi32(128 * xsum[r][b]));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(xs, wd[c]), acc[r][c]);
        if constexpr (Q4) acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(xdsum[r][b]), wm[c], acc[r][c]);
      }
    }
  }
  hi = static_cast<int>(std::min<int64_t>(hi, w.N - p * Int8Weights::kPanel));
  const uint32_t lanes = (hi >= 32 ? 0xFFFFFFFFu : (1u << hi) - 1) & ~((1u << lo) - 1);  // bit l: lane l stored
  for (int c = 0; c < 2; ++c) {
    const int64_t first = p * Int8Weights::kPanel + c * kGroup;
    const __mmask16 mask = static_cast<__mmask16>(lanes >> (16 * c));
    if (mask == 0) continue;
    __m512 bias = _mm512_setzero_ps();
    if (w.bias != nullptr) bias = _mm512_maskz_loadu_ps(mask, w.bias + first);
    for (int r = 0; r < R; ++r) {
      __m512 v = acc[r][c];
      if (w.bias != nullptr) v = _mm512_add_ps(v, bias);
      _mm512_mask_storeu_ps(out + r * ldo + c * kGroup, mask, v);
    }
  }
}

constexpr int kTileRows = 6;  // rows per tile at most: 2 x 6 integer sums + 2 x 6 accumulators in registers

// Columns [n0, n1) (for_panel_tiles); what each tile asks for ahead of its loads: Prefetch.
template <bool Q4>
void columns_vnni(const Int8Weights& w, const QuantRows& x, int64_t M, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  constexpr int64_t P = Int8Weights::kPanel;
  // one row: up to the end of the columns' stream; several: on into the next panel (the claims hand a thread
  // runs of consecutive tasks, so that is mostly its own next task)
  const uint8_t* end = w.at(M > 1 ? w.panels : (n1 + P - 1) / P, 0);
  auto tile = [&](int64_t p, int lo, int hi, int64_t r, int64_t rows, int64_t t, int64_t tiles) {
    Prefetch pf;
    pf.end = end;
    pf.parts = static_cast<int>(tiles);
    pf.part = static_cast<int>(t);
    if (!Q4 && tiles > 1 && p + 1 < w.panels) pf.next = w.at(p + 1, 0);
    float* o = out + r * ldo + p * P;
    switch (rows) {
      case 1: panel_tile<1, Q4>(w, p, x, r, o, ldo, lo, hi, pf); break;
      case 2: panel_tile<2, Q4>(w, p, x, r, o, ldo, lo, hi, pf); break;
      case 3: panel_tile<3, Q4>(w, p, x, r, o, ldo, lo, hi, pf); break;
      case 4: panel_tile<4, Q4>(w, p, x, r, o, ldo, lo, hi, pf); break;
      case 5: panel_tile<5, Q4>(w, p, x, r, o, ldo, lo, hi, pf); break;
      default: panel_tile<kTileRows, Q4>(w, p, x, r, o, ldo, lo, hi, pf); break;
    }
  };
  for_panel_tiles(M, n0, n1, kTileRows, tile);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TREESPEC_INT8_AVX2 1

// Records ahead of the one being computed that a panel's first row tile asks for (into L1): the hardware
// prefetcher alone does not keep the stream full. Measured on the 2-core Zen 3 EPYC over a whole SmolLM2
// step's int8 weights (96 MB, 2 threads, one row): 6.0-6.7 ms with each quarter of a panel walked on its own
// (the kernel before), 5.3-6.3 in one pass, 4.2-4.4 in one pass with 2-8 records ahead (4 best). In the
// native step the linears of 1-3 rows cost 1.15-1.3x less; from 4 rows the arithmetic bounds them as before.
constexpr int64_t kAheadAvx2 = 4;

// An empty asm that takes v in a vector register and may change it: the compiler cannot move the operations
// that feed v past this point or merge them with later ones. Without it gcc hoists a tile's byte products
// ahead of their sums and spills them; with it, on the 2-core Zen 3 EPYC over a SmolLM2 step's int8 weights
// (2 threads, alternated, best of 15): 4 rows 7.88 -> 6.66 ms, 8 rows 14.7 -> 12.1, 16 rows 26.8 -> 24.6,
// 1-3 rows unchanged. The integer sums are exact, so the bits do not change.
inline void keep_in_register(__m256i& v) { asm volatile("" : "+x"(v)); }

// out[r * ldo + 32p + l] (+ bias) for the lanes l of quarters c0 .. c0 + Q - 1 of panel p in [lo, hi) (hi <= N - 32p):
// acc[r][c] holds lanes 8 (c0 + c) .. 8 (c0 + c) + 7 of row r.
template <int R, int Q>
void store_lanes(const Int8Weights& w, int64_t p, int c0, const __m256 (&acc)[R][Q], float* out, int64_t ldo, int lo,
                 int hi) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int c = 0; c < Q; ++c) {
    const __m256i l = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * (c0 + c)));
    const __m256i mask =
        _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(lo), l), _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), l));
    if (_mm256_testz_si256(mask, mask)) continue;
    const int64_t first = p * Int8Weights::kPanel + 8 * (c0 + c);
    __m256 bias = _mm256_setzero_ps();
    if (w.bias != nullptr) bias = _mm256_maskload_ps(w.bias + first, mask);
    for (int r = 0; r < R; ++r) {
      __m256 v = acc[r][c];
      if (w.bias != nullptr) v = _mm256_add_ps(v, bias);
      _mm256_maskstore_ps(out + r * ldo + first, mask, v);
    }
  }
}

// R rows of x (from r0) against the 32 weight rows of panel p, in one pass over the panel's records (so the
// weights stream sequentially): out[r * ldo + 32p + l] for the lanes l in [lo, hi) below N. Per block, each
// quarter (8 weight rows: group c / 2, half c % 2) is one 8-lane vector of integer sums per row, then the
// block's float step:  acc = fma(float(isum), xd * d, acc)  (+ fma(xd * xsum, m, acc) for Q4_1).
// fetch: ask for the records kAheadAvx2 ahead (the first row tile of a panel; the others find it in L1).
// It serves one-row tiles (from 2 rows panel_groups_avx2 below is faster; the results are the same bits).
template <int R, bool Q4>
void panel_avx2(const Int8Weights& w, int64_t p, const QuantRows& x, int64_t r0, float* out, int64_t ldo, int lo,
                int hi, bool fetch) {
  constexpr int64_t kQuant = Q4 ? 256 : 512;  // quant bytes of one group in a record
  const int64_t blocks = w.blocks, record = w.record;
  const uint8_t* rec = w.at(p, 0);
  const uint8_t* end = w.at(w.panels, 0);
  const int8_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = x.q.data() + (r0 + r) * x.K;
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; ++b, rec += record) {
    if (fetch)
      for (const uint8_t* line = rec + kAheadAvx2 * record; line < rec + (kAheadAvx2 + 1) * record && line < end;
           line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(rec + 2 * kQuant);
    for (int c = 0; c < 4; ++c) {
      const uint8_t* quants = rec + (c / 2) * kQuant + 32 * (c % 2);
      __m256i isum[R];
      if constexpr (Q4) {
        // chunk j: low nibbles k = 8j .. 8j + 3, high nibbles k = 8j + 4 .. 8j + 7. |pair| <= 2 * 15 * 127, so
        // a block's 8 pair vectors sum in 16 bits (<= 30480) and widen once
        __m256i pairs[R];
        for (int j = 0; j < 4; ++j) {
          const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(quants + 64 * j));
          const __m256i q_lo = _mm256_and_si256(v, low), q_hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int r = 0; r < R; ++r) {
            const int32_t* x4 = reinterpret_cast<const int32_t*>(xq[r] + 32 * b);
            const __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(q_lo, _mm256_set1_epi32(x4[2 * j])),
                                                  _mm256_maddubs_epi16(q_hi, _mm256_set1_epi32(x4[2 * j + 1])));
            pairs[r] = j == 0 ? both : _mm256_add_epi16(pairs[r], both);
            keep_in_register(pairs[r]);
          }
        }
        for (int r = 0; r < R; ++r) isum[r] = _mm256_madd_epi16(pairs[r], ones);
      } else {
        // q = stored byte - 128 as a signed byte; |pair| <= 2 * 127 * 127 (two could overflow 16 bits), so
        // each widens, through the sign trick |q| * sign(x, q)
        for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const __m256i stored = _mm256_load_si256(reinterpret_cast<const __m256i*>(quants + 64 * j));
          const __m256i q = _mm256_xor_si256(stored, flip);
          const __m256i q_abs = _mm256_abs_epi8(q);
          for (int r = 0; r < R; ++r) {
            const __m256i xv = _mm256_set1_epi32(reinterpret_cast<const int32_t*>(xq[r] + 32 * b)[j]);
            const __m256i pairs = _mm256_maddubs_epi16(q_abs, _mm256_sign_epi8(xv, q));
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pairs, ones));
            keep_in_register(isum[r]);
          }
        }
      }
      const __m256 wd = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(scales + 8 * c)));
      __m256 wm = _mm256_setzero_ps();
      if constexpr (Q4) wm = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(scales + 32 + 8 * c)));
      for (int r = 0; r < R; ++r) {
        const int64_t xb = (r0 + r) * x.blocks + b;
        const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(x.d[xb]), wd);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r][c]);
        if constexpr (Q4) acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(x.dsum[xb]), wm, acc[r][c]);
      }
    }
  }
  hi = static_cast<int>(std::min<int64_t>(hi, w.N - p * Int8Weights::kPanel));
  store_lanes<R, 4>(w, p, 0, acc, out, ldo, lo, hi);
}

// R rows of x (from r0) against panel p in one pass over its records, a block's two groups of 16 weight rows
// one after the other: each weight vector is unpacked once for the R rows, and each row's activations are
// broadcast once for the two quarters of a group (the kernel above broadcasts them for each quarter and keeps
// a row's four quarters' integer sums apart). The float steps are the kernel above's, so are the bits.
// Q8 here splits each stored byte (q + 128) into nibbles, like a Q4_1 byte: isum = 16 * high + low - 128 * xsum,
// each nibble's 16-bit pair sums summed over the block (|sum| <= 16 * 15 * 127), which spares the sign trick's
// per-row `vpsignb`. Measured on the 2-core Zen 3 EPYC, one thread, cycles per (row, block, panel), the kernel
// above -> this one: weights in L2, Q4_1 2 rows 61 -> 46, 4 rows 50 -> 39, 16 rows 48 -> 37; Q8 71-86 -> 68-74;
// weights from memory (16384 x 1536 Q4_1): 2 rows 63 -> 51, 4 rows 50 -> 41, 16 rows 50 -> 38. (Two passes,
// one per group, ran ~32 in L2 at 4 rows but lost to the kernel above at 2 rows from memory.)
// fetch: ask for the records kAheadAvx2 ahead (the first row tile of a panel).
// (Not inlined: inlined into the tile switch, gcc allocated its registers worse, ~38 against ~32 in L2.)
template <int R, bool Q4>
__attribute__((noinline)) void panel_groups_avx2(const Int8Weights& w, int64_t p, const QuantRows& x, int64_t r0,
                                                 float* out, int64_t ldo, int lo, int hi, bool fetch) {
  constexpr int64_t kQuant = Q4 ? 256 : 512;  // quant bytes of one group in a record
  constexpr int kChunks = Q4 ? 4 : 8;         // 64-byte chunks of a group's quants
  constexpr int kSums = Q4 ? 1 : 2;           // 16-bit sums per (row, quarter): Q8 keeps its nibbles apart
  const int64_t blocks = w.blocks, record = w.record;
  const uint8_t* end = w.at(w.panels, 0);
  hi = static_cast<int>(std::min<int64_t>(hi, w.N - p * Int8Weights::kPanel));
  const int8_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = x.q.data() + (r0 + r) * x.K;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1), sixteens = _mm256_set1_epi16(16);
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  const uint8_t* rec = w.at(p, 0);
  for (int64_t b = 0; b < blocks; ++b, rec += record) {
    for (int g = 0; g < 2; ++g) {
      if (fetch && g == 0)
        for (const uint8_t* line = rec + kAheadAvx2 * record; line < rec + (kAheadAvx2 + 1) * record && line < end;
             line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
      const uint8_t* quants = rec + g * kQuant;
      __m256i sums[R][2][kSums];
#pragma GCC unroll 8
      for (int j = 0; j < kChunks; ++j) {
        __m256i q_lo[2], q_hi[2];  // the two quarters' nibbles
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(quants + 64 * j + 32 * h));
          q_lo[h] = _mm256_and_si256(v, low);
          q_hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        for (int r = 0; r < R; ++r) {
          const int32_t* x4 = reinterpret_cast<const int32_t*>(xq[r] + 32 * b);
          if constexpr (Q4) {  // chunk j: low nibbles k = 8j .. 8j + 3, high nibbles k = 8j + 4 .. 8j + 7
            const __m256i x_lo = _mm256_set1_epi32(x4[2 * j]), x_hi = _mm256_set1_epi32(x4[2 * j + 1]);
            for (int h = 0; h < 2; ++h) {
              const __m256i both =
                  _mm256_add_epi16(_mm256_maddubs_epi16(q_lo[h], x_lo), _mm256_maddubs_epi16(q_hi[h], x_hi));
              sums[r][h][0] = j == 0 ? both : _mm256_add_epi16(sums[r][h][0], both);
              keep_in_register(sums[r][h][0]);
            }
          } else {  // chunk j: both nibbles of k = 4j .. 4j + 3
            const __m256i xv = _mm256_set1_epi32(x4[j]);
            for (int h = 0; h < 2; ++h) {
              const __m256i high = _mm256_maddubs_epi16(q_hi[h], xv), lower = _mm256_maddubs_epi16(q_lo[h], xv);
              sums[r][h][0] = j == 0 ? high : _mm256_add_epi16(sums[r][h][0], high);
              sums[r][h][1] = j == 0 ? lower : _mm256_add_epi16(sums[r][h][1], lower);
              keep_in_register(sums[r][h][0]);
              keep_in_register(sums[r][h][1]);
            }
          }
        }
      }
      const uint16_t* scales = reinterpret_cast<const uint16_t*>(rec + 2 * kQuant) + 16 * g;
      for (int h = 0; h < 2; ++h) {
        const __m256 wd = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(scales + 8 * h)));
        __m256 wm = _mm256_setzero_ps();
        if constexpr (Q4) wm = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(scales + 32 + 8 * h)));
        for (int r = 0; r < R; ++r) {
          const int64_t xb = (r0 + r) * x.blocks + b;
          __m256i isum;
          if constexpr (Q4) {
            isum = _mm256_madd_epi16(sums[r][h][0], ones);
          } else {
            isum = _mm256_add_epi32(_mm256_madd_epi16(sums[r][h][0], sixteens), _mm256_madd_epi16(sums[r][h][1], ones));
            isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(128 * x.sum[xb]));
          }
          const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(x.d[xb]), wd);
          acc[r][2 * g + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r][2 * g + h]);
          if constexpr (Q4) acc[r][2 * g + h] = _mm256_fmadd_ps(_mm256_set1_ps(x.dsum[xb]), wm, acc[r][2 * g + h]);
        }
      }
    }
  }
  store_lanes<R, 4>(w, p, 0, acc, out, ldo, lo, hi);
}

constexpr int kRowsAvx2 = 4;  // rows per tile at most (4 x 4 accumulators)

// Columns [n0, n1) (for_panel_tiles): one-row tiles in panel_avx2 (a one-row step streams the weights from
// memory, where that kernel keeps up), tiles of 2 to 4 rows in panel_groups_avx2; a panel's first tile asks
// for the records ahead.
template <bool Q4>
void columns_avx2(const Int8Weights& w, const QuantRows& x, int64_t M, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  auto tile = [&](int64_t p, int lo, int hi, int64_t r, int64_t rows, int64_t t, int64_t) {
    float* o = out + r * ldo;
    switch (rows) {
      case 1: panel_avx2<1, Q4>(w, p, x, r, o, ldo, lo, hi, t == 0); break;
      case 2: panel_groups_avx2<2, Q4>(w, p, x, r, o, ldo, lo, hi, t == 0); break;
      case 3: panel_groups_avx2<3, Q4>(w, p, x, r, o, ldo, lo, hi, t == 0); break;
      default: panel_groups_avx2<kRowsAvx2, Q4>(w, p, x, r, o, ldo, lo, hi, t == 0); break;
    }
  };
  for_panel_tiles(M, n0, n1, kRowsAvx2, tile);
}
#endif

}  // namespace

void AlignedBytes::allocate(int64_t size) {
  if (size <= 0) return;
  constexpr size_t kHuge = size_t{2} << 20;
  const bool huge = static_cast<size_t>(size) >= kHuge;
  const size_t align = huge ? kHuge : 64;
  const size_t bytes = (static_cast<size_t>(size) + align - 1) / align * align;
  void* p = nullptr;
  if (posix_memalign(&p, align, bytes) != 0) throw std::bad_alloc();
#if defined(MADV_HUGEPAGE)
  if (huge) madvise(p, bytes, MADV_HUGEPAGE);  // a request: where it is refused the buffer still works
#endif
  data_ = static_cast<uint8_t*>(p);
  size_ = size;
}

AlignedBytes::~AlignedBytes() { std::free(data_); }

int64_t int8_bytes(bool q4, int64_t N, int64_t K) {
  return (N + Int8Weights::kPanel - 1) / Int8Weights::kPanel * (K / 32) * (q4 ? 640 : 1088);
}

Int8Weights repack_int8(const LinearWeights& w, uint8_t* into) {
  Int8Weights out;
  out.q4 = w.kind == WeightKind::kQ4_1;
  out.N = w.N;
  out.K = w.K;
  out.panels = (w.N + Int8Weights::kPanel - 1) / Int8Weights::kPanel;
  out.blocks = w.K / 32;
  out.record = out.q4 ? 640 : 1088;
  out.bias = w.bias;
  const int64_t B = out.blocks, G = 2 * out.panels;
  if (into == nullptr) {
    out.own = AlignedBytes(int8_bytes(out.q4, out.N, out.K));
    into = out.own.data();
  }
  out.data = into;
  std::memset(into, 0, out.bytes());  // padding rows: d = m = 0 (and Q4_1 q = 0)
  if (!out.q4)  // padding rows of Q8: q = 0, stored + 128
    for (int64_t g = 0; g < G; ++g)
      for (int64_t b = 0; b < B; ++b) std::memset(const_cast<uint8_t*>(out.quants(g, b)), 128, 512);
  for (int64_t n = 0; n < w.N; ++n) {
    const int64_t g = n / kGroup;
    const int c = static_cast<int>(n % kGroup);
    for (int64_t b = 0; b < B; ++b) {
      uint8_t* block = const_cast<uint8_t*>(out.quants(g, b));
      const_cast<uint16_t*>(out.d(g, b))[c] = scale_bits(w.d, w.half_scales, n * B + b);
      if (out.q4) {
        const_cast<uint16_t*>(out.m(g, b))[c] = scale_bits(w.m, w.half_scales, n * B + b);
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
#elif defined(__AVX2__)
  // the scalar loop below, 8 lanes at a time: the same multiplications and round-to-nearest-even
  // conversions, so the same bytes
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t b = b0; b < b1; ++b) {
    const float* xb = x + 32 * b;
    __m256 v[4];
    __m256 amax8 = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float d = amax / 127.0f;
    const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse))));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows.q.data() + r * rows.K + 32 * b),
                        _mm256_permutevar8x32_epi32(bytes, order));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    const int32_t sum = _mm_cvtsi128_si32(s4);
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
        const int64_t xb = r * x.blocks + b;
        const int32_t isum = integer_sum(w, g, b, c, x.q.data() + r * x.K + 32 * b, x.sum[xb]);
        const float s = x.d[xb] * half_to_float(w.d(g, b)[c]);
        acc = std::fma(static_cast<float>(isum), s, acc);
        if (w.q4) acc = std::fma(x.dsum[xb], half_to_float(w.m(g, b)[c]), acc);
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
