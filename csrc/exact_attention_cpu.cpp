// Row-invariant tree attention on the CPU (exact.h; the contract of tree_attention.h).
//
// Query token i of a forward over n new tokens after c committed ones sees T_i keys: the prefix [0, c),
// then the block keys c + j it may see (its ancestors and itself, j ascending). In a tree those are the
// keys of its path in depth order, so the logical key list is exactly the list a one-token step at the
// same position sees. Every sum below runs over that logical index, so its order does not depend on n,
// on the other rows of the tree, or on the batch:
//   s_t = (q . k_t) * scale * log2(e)     (dot over D: one VL-wide chain of FMAs, lanes pairwise, tail FMAs)
//   m = max_t s_t;  p_t = 2^(s_t - m)     (the polynomial exp2 of vec.h, elementwise)
//   l = sum_t p_t                         (VL partial sums over t in chunks from t = 0, lanes pairwise)
//   out = (sum_t p_t v_t) / l             (each d: one FMA per t = 0, 1, ... in order)
// Every multiply-add is an explicit FMA (`fmadd`), so a row's bits do not hang on the compiler's choice to
// fuse or not, which differed between the tiles and the one-row code.
// Work: one task per (batch, kv head, tile of query tokens); a K or V row loaded once serves every query
// head of the group and every token of the tile, but each row keeps its own accumulators.
// K / V may be bf16 under float32 queries (`kv_bf16`): widened to float32 exactly where they are read, so
// the result equals the float32 kernel's over the same (bf16-valued) keys and values, bit for bit.

#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "exact.h"
#include "vec.h"

namespace treespec {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kTokens = 8;  // query tokens per task

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

inline float dot(const float* q, const float* k, int D) {
  vf acc = splat(0.0f);
  int d = 0;
  for (; d + VL <= D; d += VL) acc = fmadd(loadv(q + d), loadv(k + d), acc);
  float s = lane_sum(acc);
  for (; d < D; ++d) s = __builtin_fmaf(q[d], k[d], s);
  return s;
}

inline void axpy(float* o, float p, const float* v, int D) {  // o += p * v
  const vf pv = splat(p);
  int d = 0;
  for (; d + VL <= D; d += VL) storev(o + d, fmadd(pv, loadv(v + d), loadv(o + d)));
  for (; d < D; ++d) o[d] = __builtin_fmaf(p, v[d], o[d]);
}

// Row t of a [L, D] K or V head as fp32: in place for fp32, converted into buf for bf16.
template <typename T>
inline const float* key_row(const T* base, int64_t stride, int t, int D, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return base + t * stride;
  } else {
    bf16_row_to_float(base + t * stride, buf, D);
    return buf;
  }
}

// Rows [0, count) of a K or V head from `base` as float32 rows, and their stride: in place for fp32, each
// widened once into buf for bf16 (the block keys a task's tokens read, once per task rather than per token).
template <typename T>
inline std::pair<const float*, int64_t> float_rows(const T* base, int64_t stride, int count, int D,
                                                   std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return {base, stride};
  } else {
    buf.resize(static_cast<size_t>(count) * D);
    for (int j = 0; j < count; ++j) bf16_row_to_float(base + j * stride, &buf[static_cast<size_t>(j) * D], D);
    return {buf.data(), D};
  }
}

// Whether query token i (of the block) sees block key j.
inline bool visible(const TreeAttentionParams& p, int i, int j) {
  if (p.bits == nullptr) return j <= i;
  return (p.bits[static_cast<int64_t>(i) * p.words + j / 64] >> (j % 64)) & 1u;
}

struct Scratch {
  std::vector<float> q, s, o, row, rows, sums, block_k, block_v;
  std::vector<std::vector<int>> block;  // per token of the tile: the block keys it sees, ascending
};

// Scores of prefix keys for all R rows through the lane-sum network (each score the additions of `dot`:
// one VL-wide chain of FMAs over d, then the lanes pairwise), which reduces VL vectors at once: a tile of
// 2 rows x VL / 2 keys, each key vector loaded feeding both rows; a row left over takes VL keys at a time
// alone. Keys run in chunks of VL, outermost: each chunk is read (bf16: widened) once for every row of the
// task, from L1. Returns the first key it did not score (the caller scores the rest with `dot`; every row
// the same count, so a row's split into network and `dot` keys depends on c only).
template <typename T>
int prefix_scores(const TreeAttentionParams& p, const T* k, int c, int R, int Tp, float scale, Scratch& w) {
#if TREESPEC_LANE_SUMS
  constexpr int kKeys = VL / 2;  // keys per tile of 2 rows
  const int D = p.head_dim;
  if (D % VL != 0) return 0;
  w.rows.resize(static_cast<size_t>(VL) * D);
  const int end = c / VL * VL;  // keys [0, end) through the network, for every row
  const int* vector_of_lane = lane_sums_vector();
  vi lane_of;  // lane_of[v]: the output lane that holds vector v's sum (v = row of the pair * kKeys + key)
  for (int l = 0; l < VL; ++l) lane_of[vector_of_lane[l]] = l;
  const vf scales = splat(scale);
  for (int t = 0; t < end; t += VL) {
    const float* kt[VL];  // the chunk's keys as float32 rows
    for (int x = 0; x < VL; ++x) kt[x] = key_row<T>(k, p.k_stride_l, t + x, D, &w.rows[x * D]);
    int r = 0;
    for (; r + 2 <= R; r += 2) {
      const float* q0 = &w.q[r * D];
      const float* q1 = &w.q[(r + 1) * D];
      for (int half = 0; half < VL; half += kKeys) {
        vf acc[VL];  // [row of the pair * kKeys + key]
        for (int x = 0; x < kKeys; ++x) acc[x] = acc[kKeys + x] = splat(0.0f);
        for (int d = 0; d < D; d += VL) {
          const vf a0 = loadv(q0 + d), a1 = loadv(q1 + d);
          for (int x = 0; x < kKeys; ++x) {
            const vf kv = loadv(kt[half + x] + d);
            acc[x] = fmadd(a0, kv, acc[x]);
            acc[kKeys + x] = fmadd(a1, kv, acc[kKeys + x]);
          }
        }
        const vf sums = __builtin_shuffle(lane_sums(acc), lane_of) * scales;  // [2, kKeys] in key order
        std::memcpy(&w.s[r * Tp + t + half], &sums, kKeys * sizeof(float));
        std::memcpy(&w.s[(r + 1) * Tp + t + half], reinterpret_cast<const float*>(&sums) + kKeys,
                    kKeys * sizeof(float));
      }
    }
    for (; r < R; ++r) {  // one row, the chunk's VL keys at once
      const float* qr = &w.q[r * D];
      vf acc[VL];
      for (int x = 0; x < VL; ++x) {
        vf a = splat(0.0f);
        for (int d = 0; d < D; d += VL) a = fmadd(loadv(qr + d), loadv(kt[x] + d), a);
        acc[x] = a;
      }
      const vf sums = lane_sums(acc);
      float* s = &w.s[r * Tp + t];
      for (int l = 0; l < VL; ++l) s[vector_of_lane[l]] = sums[l] * scale;
    }
  }
  return end;
#else
  return 0;
#endif
}

// o[r] += sum over keys t in [t0, t1) of p[r][t] v_t for the NDV output vectors from column `col`, rows RT
// at a time with those vectors held in registers (the same multiply-adds, in the same order, as `axpy` key
// after key): each V row loaded feeds RT rows. vrows: key t0's V row as float32, key t's `stride` floats on.
// The accumulators start from (and end in) w.o, so splitting the keys into runs changes no bit.
template <int NDV>
void prefix_values_tiled(const float* vrows, int64_t stride, int t0, int t1, int R, int Tp, int D, int col,
                         Scratch& w) {
  // RT x NDV accumulators, NDV values and a broadcast weight: 32 registers (VL 16) or 16 (VL 8)
  constexpr int RT = VL == 16 ? (NDV <= 2 ? 8 : 6) : (NDV == 1 ? 8 : NDV == 2 ? 6 : NDV == 3 ? 4 : 3);
  for (int r0 = 0; r0 < R; r0 += RT) {
    const int rows = std::min(RT, R - r0);
    vf acc[RT][NDV];
    for (int i = 0; i < RT; ++i)
      for (int j = 0; j < NDV; ++j) acc[i][j] = i < rows ? loadv(&w.o[(r0 + i) * D + col + j * VL]) : splat(0.0f);
    for (int t = t0; t < t1; ++t) {
      const float* vt = vrows + (t - t0) * stride + col;
      vf vv[NDV];
      for (int j = 0; j < NDV; ++j) vv[j] = loadv(vt + j * VL);
      for (int i = 0; i < RT; ++i) {
        if (i >= rows) break;
        const vf pv = splat(w.s[(r0 + i) * Tp + t]);
        for (int j = 0; j < NDV; ++j) acc[i][j] = fmadd(pv, vv[j], acc[i][j]);
      }
    }
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < NDV; ++j) storev(&w.o[(r0 + i) * D + col + j * VL], acc[i][j]);
  }
}

// Keys [t0, t1) of the prefix values (rows as prefix_values_tiled reads them), up to 4 vectors at a time.
inline void prefix_value_columns(const float* vrows, int64_t stride, int t0, int t1, int R, int Tp, int D, Scratch& w) {
  for (int col = 0; col < D; col += 4 * VL) {
    switch (std::min(4, (D - col) / VL)) {
      case 1: prefix_values_tiled<1>(vrows, stride, t0, t1, R, Tp, D, col, w); break;
      case 2: prefix_values_tiled<2>(vrows, stride, t0, t1, R, Tp, D, col, w); break;
      case 3: prefix_values_tiled<3>(vrows, stride, t0, t1, R, Tp, D, col, w); break;
      default: prefix_values_tiled<4>(vrows, stride, t0, t1, R, Tp, D, col, w); break;
    }
  }
}

constexpr int kValueChunk = 64;  // bf16 V rows widened at a time (16 KB at D 64: L1)

template <typename T>
void prefix_values(const TreeAttentionParams& p, const T* v, int c, int R, int Tp, Scratch& w) {
  const int D = p.head_dim;
  if (D % VL == 0) {
    if constexpr (std::is_same_v<T, float>) {
      prefix_value_columns(v, p.v_stride_l, 0, c, R, Tp, D, w);
    } else {  // bf16: each chunk of V rows widened once, then read by every row tile from L1
      w.rows.resize(std::max<size_t>(w.rows.size(), static_cast<size_t>(kValueChunk) * D));
      for (int t0 = 0; t0 < c; t0 += kValueChunk) {
        const int t1 = std::min(c, t0 + kValueChunk);
        for (int t = t0; t < t1; ++t) bf16_row_to_float(v + t * p.v_stride_l, &w.rows[(t - t0) * D], D);
        prefix_value_columns(w.rows.data(), D, t0, t1, R, Tp, D, w);
      }
    }
    return;
  }
  for (int t = 0; t < c; ++t) {
    const float* vt = key_row<T>(v, p.v_stride_l, t, D, w.row.data());
    for (int r = 0; r < R; ++r) axpy(&w.o[r * D], w.s[r * Tp + t], vt, D);
  }
}

template <typename T, typename TKV>
void run_task(const TreeAttentionParams& p, int64_t task, Scratch& w) {
  // n queries, tokens query_offset.. of a block of block_n tokens after c committed keys
  const int G = p.heads / p.kv_heads, n = p.n, D = p.head_dim;
  const int block_n = p.block_n > 0 ? p.block_n : n, c = p.kv_len - block_n;
  const int tiles = (n + kTokens - 1) / kTokens;
  const int b = static_cast<int>(task / (int64_t(p.kv_heads) * tiles));
  const int kvh = static_cast<int>(task / tiles % p.kv_heads), i0 = static_cast<int>(task % tiles) * kTokens;
  const int tokens = std::min(kTokens, n - i0), R = tokens * G;  // row r = token ii * G + head g
  const T* q = static_cast<const T*>(p.q) + b * p.q_stride_b;
  const TKV* k = static_cast<const TKV*>(p.k) + b * p.k_stride_b + kvh * p.k_stride_h;
  const TKV* v = static_cast<const TKV*>(p.v) + b * p.v_stride_b + kvh * p.v_stride_h;
  int most = 0;
  w.block.resize(tokens);
  for (int ii = 0; ii < tokens; ++ii) {
    w.block[ii].clear();
    for (int j = 0; j < block_n; ++j)
      if (visible(p, p.query_offset + i0 + ii, j)) w.block[ii].push_back(j);
    most = std::max(most, static_cast<int>(w.block[ii].size()));
  }
  const int Tp = round_up(c + most, VL);  // score row stride, padded to whole vectors
  w.q.resize(static_cast<size_t>(R) * D);
  w.s.resize(static_cast<size_t>(R) * Tp);
  for (int r = 0; r < R; ++r)  // the padding of each score row (every key before it is written below)
    std::fill(w.s.begin() + r * Tp + c + static_cast<int>(w.block[r / G].size()), w.s.begin() + (r + 1) * Tp, kNegInf);
  w.o.assign(static_cast<size_t>(R) * D, 0.0f);
  w.row.resize(D);
  w.sums.resize(R);
  const float scale = p.scale * kLog2e;
  for (int r = 0; r < R; ++r) {
    const T* qr = q + (kvh * G + r % G) * p.q_stride_h + (i0 + r / G) * p.q_stride_n;
    for (int d = 0; d < D; ++d) w.q[r * D + d] = to_float<T>(qr[d]);
  }
  // scores: the prefix keys for every row, then each token's block keys
  const int t = prefix_scores<TKV>(p, k, c, R, Tp, scale, w);
  for (int u = t; u < c; ++u) {
    const float* ku = key_row<TKV>(k, p.k_stride_l, u, D, w.row.data());
    for (int r = 0; r < R; ++r) w.s[r * Tp + u] = dot(&w.q[r * D], ku, D) * scale;
  }
  int seen = 0;  // block keys [0, seen) hold every one the tile's tokens see
  for (int ii = 0; ii < tokens; ++ii)
    if (!w.block[ii].empty()) seen = std::max(seen, w.block[ii].back() + 1);
  const auto [block_k, k_stride] = float_rows<TKV>(k + c * p.k_stride_l, p.k_stride_l, seen, D, w.block_k);
  for (int ii = 0; ii < tokens; ++ii)
    for (size_t x = 0; x < w.block[ii].size(); ++x) {
      const float* kt = block_k + w.block[ii][x] * k_stride;
      for (int g = 0; g < G; ++g) w.s[(ii * G + g) * Tp + c + x] = dot(&w.q[(ii * G + g) * D], kt, D) * scale;
    }
  // softmax weights, unnormalised, and their sums (padding: 2^-inf = 0 adds nothing)
  for (int r = 0; r < R; ++r) {
    float* s = &w.s[r * Tp];
    // the largest score: a VL-lane max over the row, padding (-inf) included, then over the lanes. A max
    // is exact, so any order gives the same value (up to the sign of a zero, which 2^(s - m) does not see)
    vf mv = splat(kNegInf);
    for (int t = 0; t < Tp; t += VL) mv = vmax(mv, loadv(s + t));
    float lanes[VL];
    storev(lanes, mv);
    float m = kNegInf;
    for (int l = 0; l < VL; ++l) m = std::max(m, lanes[l]);
    vf sum = splat(0.0f);
    for (int t = 0; t < Tp; t += VL) {
      const vf e = exp2v(loadv(s + t) - splat(m));
      storev(s + t, e);
      sum += e;
    }
    w.sums[r] = lane_sum(sum);
  }
  // outputs: the prefix values for every row, then each token's block values, in the key order above
  prefix_values<TKV>(p, v, c, R, Tp, w);
  const auto [block_v, v_stride] = float_rows<TKV>(v + c * p.v_stride_l, p.v_stride_l, seen, D, w.block_v);
  for (int ii = 0; ii < tokens; ++ii)
    for (size_t x = 0; x < w.block[ii].size(); ++x) {
      const float* vt = block_v + w.block[ii][x] * v_stride;
      for (int g = 0; g < G; ++g) axpy(&w.o[(ii * G + g) * D], w.s[(ii * G + g) * Tp + c + x], vt, D);
    }
  T* out = static_cast<T*>(p.out);
  for (int r = 0; r < R; ++r) {
    const int64_t row = (static_cast<int64_t>(b) * n + i0 + r / G) * p.heads + kvh * G + r % G;  // [B, n, H]
    for (int d = 0; d < D; ++d) out[row * D + d] = from_float<T>(w.o[r * D + d] / w.sums[r]);
  }
}

template <typename T, typename TKV = T>
void run(const TreeAttentionParams& p) {
  const int tiles = (p.n + kTokens - 1) / kTokens;
  const int64_t tasks = static_cast<int64_t>(p.batch) * p.kv_heads * tiles;
  auto worker = [&](int64_t first, int64_t last) {
    static thread_local Scratch scratch;  // kept between calls: no allocation per call in steady state
    for (int64_t task = first; task < last; ++task) run_task<T, TKV>(p, task, scratch);
  };
  if (p.serial)
    worker(0, tasks);
  else
    at::parallel_for(0, tasks, 1, worker);
}

}  // namespace

void tree_attention_exact_cpu(const TreeAttentionParams& p) {
  if (p.dtype == DType::kBFloat16)
    run<uint16_t>(p);
  else if (p.kv_bf16)
    run<float, uint16_t>(p);  // bf16 K / V under float32 q: each K / V element widened exactly, same sums
  else
    run<float>(p);
}

}  // namespace treespec
