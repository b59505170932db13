// CPU tree attention and fused KV commit (see tree_attention.h for the contract).
//
// Work split: one task per (batch, kv head, query tile, key split). A query tile holds the G query
// heads of one KV group for up to kRowTarget / G consecutive query tokens, so every K/V tile that a
// task streams through the cache is used by all the rows that need it. Rows are ordered
// (token, head-in-group), which is also the order of the [B, n, H, D] output.
//
// Inside a task, flash-attention style online softmax over K/V tiles of 64 keys (256 for the prefix
// on the AMX engine), never an [n, L] score matrix. The committed prefix is tiled from 0; the tree
// block is tiled from c, so a tree tile is one 64-bit ancestor word of each row.
//
// Two engines compute a task:
//  - FmaEngine (fp32 and bf16 inputs, any CPU): scores kept transposed, St[key][row], with the rows
//    along the SIMD lanes. Q is packed once per task as Qt[d][row] (scaled by scale * log2 e, so the
//    softmax uses exp2), K is read in place through its strides (a broadcast per key and d), the
//    row-wise max / exp / sum of the online softmax are plain vertical vector operations, and P.V
//    broadcasts P[key][row] against rows of V. bf16 K/V tiles (and fp32 tiles whose head dim is not
//    a multiple of the vector width) are converted into small fp32 tiles first; all arithmetic is fp32.
//    Vectors are GCC/Clang vector extensions, sized for AVX-512 when the compiler targets it (the JIT
//    build uses -march=native) and 256-bit otherwise; the compiler lowers them for any target.
//  - AmxEngine (bf16 on CPUs with AMX, compiled in when the compiler targets AMX): Q.K^T and P.V as
//    bf16 tile products with fp32 accumulation, softmax in fp32 AVX-512; see its comment.
//
// Small problems (decode: n = 1) have few tasks; when there are fewer tasks than threads can keep busy,
// the prefix is split across tasks (flash-decoding) and the partial (max, sum, output) are merged by
// the task that finishes a group last. Tasks are handed out dynamically from an atomic counter, which
// keeps the threads busy on a machine shared with other work.

#include <ATen/Parallel.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "tree_attention.h"
#include "vec.h"

namespace treespec {
namespace {


// Register blocking of the two micro-kernels (accumulators must fit the register file).
#if TREESPEC_VL == 16
constexpr int QK_KEYS = 6, QK_ROWV = 4;  // 24 accumulators + 4 loads of the 32 zmm registers
#else
constexpr int QK_KEYS = 4, QK_ROWV = 2;  // 8 + 2 of the 16 ymm registers
#endif
constexpr int PV_ROWS = 4, PV_DV = TREESPEC_VL == 16 ? 4 : 2;

constexpr int kTile = 64;          // keys per K/V tile: a tree tile is one 64-bit ancestor word
constexpr int kRowTarget = 256;    // query rows (tokens x heads of a group) per task at most
constexpr int kMinSplitTiles = 4;  // a key split covers at least 4 tiles (256 keys)
constexpr float kLog2e = 1.4426950408889634f;
// ---- micro-kernels -------------------------------------------------------------------------------

// St[t][j*VL + lane] = sum_d K[t][d] * Qt[d][j*VL + lane] for NK keys and NRV row vectors.
template <int NK, int NRV>
inline void qk_block(const float* k, int64_t k_stride, const float* qt, int64_t qt_stride, int D,
                     float* st, int64_t st_stride) {
  vf acc[NK][NRV];
#pragma GCC unroll 8
  for (int t = 0; t < NK; ++t)
#pragma GCC unroll 8
    for (int j = 0; j < NRV; ++j) acc[t][j] = splat(0.0f);
  for (int d = 0; d < D; ++d) {
    vf q[NRV];
#pragma GCC unroll 8
    for (int j = 0; j < NRV; ++j) q[j] = loadv(qt + d * qt_stride + j * VL);
#pragma GCC unroll 8
    for (int t = 0; t < NK; ++t) {
      const float kv = k[t * k_stride + d];
#pragma GCC unroll 8
      for (int j = 0; j < NRV; ++j) acc[t][j] += kv * q[j];
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < NK; ++t)
#pragma GCC unroll 8
    for (int j = 0; j < NRV; ++j) storev(st + t * st_stride + j * VL, acc[t][j]);
}

template <int NRV>
inline void qk_rows(int nk, const float* k, int64_t k_stride, const float* qt, int64_t qt_stride, int D,
                    float* st, int64_t st_stride) {
  int t = 0;
  for (; t + QK_KEYS <= nk; t += QK_KEYS)
    qk_block<QK_KEYS, NRV>(k + t * k_stride, k_stride, qt, qt_stride, D, st + t * st_stride, st_stride);
  const float* kt = k + t * k_stride;
  float* s = st + t * st_stride;
  switch (nk - t) {
    case 1: qk_block<1, NRV>(kt, k_stride, qt, qt_stride, D, s, st_stride); break;
    case 2: qk_block<2, NRV>(kt, k_stride, qt, qt_stride, D, s, st_stride); break;
    case 3: qk_block<3, NRV>(kt, k_stride, qt, qt_stride, D, s, st_stride); break;
#if TREESPEC_VL == 16
    case 4: qk_block<4, NRV>(kt, k_stride, qt, qt_stride, D, s, st_stride); break;
    case 5: qk_block<5, NRV>(kt, k_stride, qt, qt_stride, D, s, st_stride); break;
#endif
    default: break;
  }
}

// Scores of nk keys against all rows (nrv row vectors): St [nk][Rp] (row stride Rp = nrv * VL).
// Qt has row stride qs (>= Rp, padded off powers of two so its rows spread over the cache sets).
inline void qk_tile(int nk, int nrv, const float* k, int64_t k_stride, const float* qt, int64_t qs, int D,
                    float* st) {
  const int64_t rs = static_cast<int64_t>(nrv) * VL;
  int j = 0;
  for (; j + QK_ROWV <= nrv; j += QK_ROWV) qk_rows<QK_ROWV>(nk, k, k_stride, qt + j * VL, qs, D, st + j * VL, rs);
  switch (nrv - j) {
    case 1: qk_rows<1>(nk, k, k_stride, qt + j * VL, qs, D, st + j * VL, rs); break;
#if TREESPEC_VL == 16
    case 2: qk_rows<2>(nk, k, k_stride, qt + j * VL, qs, D, st + j * VL, rs); break;
    case 3: qk_rows<3>(nk, k, k_stride, qt + j * VL, qs, D, st + j * VL, rs); break;
#endif
    default: break;
  }
}

// O[r][d0 + j*VL ..] = alpha[r] * O[r][..] + sum_t P[t][r] * V[t][d0 + j*VL ..] for NR rows, NDV vectors.
template <int NR, int NDV>
inline void pv_block(int nk, const float* p, int64_t p_stride, const float* v, int64_t v_stride, float* o,
                     int64_t o_stride, const float* alpha) {
  vf acc[NR][NDV];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
    const float a = alpha[r];
#pragma GCC unroll 8
    for (int j = 0; j < NDV; ++j) acc[r][j] = loadv(o + r * o_stride + j * VL) * a;
  }
  for (int t = 0; t < nk; ++t) {
    vf vv[NDV];
#pragma GCC unroll 8
    for (int j = 0; j < NDV; ++j) vv[j] = loadv(v + t * v_stride + j * VL);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const float pr = p[t * p_stride + r];
#pragma GCC unroll 8
      for (int j = 0; j < NDV; ++j) acc[r][j] += pr * vv[j];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NDV; ++j) storev(o + r * o_stride + j * VL, acc[r][j]);
}

template <int NR>
inline void pv_rows(int nk, const float* p, int64_t p_stride, const float* v, int64_t v_stride, float* o,
                    int64_t o_stride, int ndv, const float* alpha) {
  int j = 0;
  for (; j + PV_DV <= ndv; j += PV_DV)
    pv_block<NR, PV_DV>(nk, p, p_stride, v + j * VL, v_stride, o + j * VL, o_stride, alpha);
  switch (ndv - j) {
    case 1: pv_block<NR, 1>(nk, p, p_stride, v + j * VL, v_stride, o + j * VL, o_stride, alpha); break;
#if TREESPEC_VL == 16
    case 2: pv_block<NR, 2>(nk, p, p_stride, v + j * VL, v_stride, o + j * VL, o_stride, alpha); break;
    case 3: pv_block<NR, 3>(nk, p, p_stride, v + j * VL, v_stride, o + j * VL, o_stride, alpha); break;
#endif
    default: break;
  }
}

inline void pv_tile(int nk, int rows, const float* p, int64_t p_stride, const float* v, int64_t v_stride,
                    float* o, int64_t o_stride, int ndv, const float* alpha) {
  int r = 0;
  for (; r + PV_ROWS <= rows; r += PV_ROWS)
    pv_rows<PV_ROWS>(nk, p + r, p_stride, v, v_stride, o + r * o_stride, o_stride, ndv, alpha + r);
  switch (rows - r) {
    case 1: pv_rows<1>(nk, p + r, p_stride, v, v_stride, o + r * o_stride, o_stride, ndv, alpha + r); break;
    case 2: pv_rows<2>(nk, p + r, p_stride, v, v_stride, o + r * o_stride, o_stride, ndv, alpha + r); break;
    case 3: pv_rows<3>(nk, p + r, p_stride, v, v_stride, o + r * o_stride, o_stride, ndv, alpha + r); break;
    default: break;
  }
}

// ---- plan and tasks --------------------------------------------------------------------------------

struct Plan {
  int B, H, Hkv, G, n, L, D, W, c;
  int Dp;            // D rounded up to the vector width
  int nq;            // query tokens per tile
  int qtiles;
  int rows_max;      // nq * G
  int rp_max;        // rows_max rounded up to the vector width (a multiple of 16 too)
  int prefix_tiles;  // ceil(c / kTile)
  int splits;        // key splits of the prefix
  int split_tiles;   // prefix tiles per split
  int64_t tasks;
  bool amx;          // bf16 through the AMX engine
  float qscale;      // scale * log2(e): scores live in the log2 domain
};

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

Plan make_plan(const TreeAttentionParams& p, int threads, bool amx) {
  Plan pl;
  pl.B = p.batch;
  pl.H = p.heads;
  pl.Hkv = p.kv_heads;
  pl.G = p.heads / p.kv_heads;
  pl.n = p.n;
  pl.L = p.kv_len;
  pl.D = p.head_dim;
  pl.W = p.words;
  pl.c = p.kv_len - p.n;
  pl.Dp = round_up(pl.D, VL);
  pl.nq = std::min(pl.n, std::max(1, kRowTarget / pl.G));
  pl.qtiles = (pl.n + pl.nq - 1) / pl.nq;
  pl.rows_max = pl.nq * pl.G;
  pl.rp_max = round_up(pl.rows_max, 16);
  pl.prefix_tiles = (pl.c + kTile - 1) / kTile;
  const int64_t base = static_cast<int64_t>(pl.B) * pl.Hkv * pl.qtiles;
  int splits = 1;
  const int64_t want = 4 * static_cast<int64_t>(threads);  // tasks for dynamic balancing
  if (threads > 1 && base < want) {
    splits = static_cast<int>((want + base - 1) / base);
    splits = std::min(splits, std::max(1, pl.prefix_tiles / kMinSplitTiles));
  }
  pl.split_tiles = splits > 1 ? (pl.prefix_tiles + splits - 1) / splits : pl.prefix_tiles;
  pl.splits = splits > 1 ? (pl.prefix_tiles + pl.split_tiles - 1) / pl.split_tiles : 1;
  pl.tasks = base * pl.splits;
  pl.amx = amx;
  pl.qscale = p.scale * kLog2e;
  return pl;
}

// Ancestor word w of query token i (bits j = 64 w + t, t < 64).
inline uint64_t mask_word(const TreeAttentionParams& p, int i, int w) {
  if (p.bits != nullptr) return p.bits[static_cast<int64_t>(i) * p.words + w];
  const int lo = 64 * w;  // causal: j <= i
  if (i < lo) return 0;
  if (i - lo >= 63) return ~uint64_t{0};
  return (uint64_t{2} << (i - lo)) - 1;
}

// One task: rows r = ii * G + g (query token i0 + ii, query head kvh * G + g) over one key split.
struct Task {
  int b, kvh, split, i0, nqh, R;
};

inline Task task_of(const Plan& pl, int64_t task) {
  Task t;
  t.split = static_cast<int>(task % pl.splits);
  int64_t rest = task / pl.splits;
  const int qt = static_cast<int>(rest % pl.qtiles);
  rest /= pl.qtiles;
  t.kvh = static_cast<int>(rest % pl.Hkv);
  t.b = static_cast<int>(rest / pl.Hkv);
  t.i0 = qt * pl.nq;
  t.nqh = std::min(pl.nq, pl.n - t.i0);
  t.R = t.nqh * pl.G;
  return t;
}

// A K/V tile: keys [k0, k0 + nk); j0 >= 0 marks a tree tile holding tree nodes [j0, j0 + nk).
struct KeyTile {
  int k0, nk, j0;
};

// Per-row online-softmax state of a task: running max M and sum Ls (log2 domain), the rescale
// factor of the last tile A, and the unnormalised output O [rows][Dp].
struct RowState {
  std::vector<float> m, l, alpha, o;
  void reserve(const Plan& pl) {
    grow(m, pl.rp_max);
    grow(l, pl.rp_max);
    grow(alpha, pl.rp_max);
    grow(o, static_cast<size_t>(pl.rp_max) * pl.Dp);
  }
  template <typename V>
  static void grow(std::vector<V>& v, size_t n) {
    if (v.size() < n) v.resize(n);
  }
};

// ---- the portable engine: fp32 FMA micro-kernels (fp32 and bf16 inputs) ------------------------------

// T: q (and out); TKV: K and V (bf16 K / V under fp32 q: a cache that stores them in half the bytes)
template <typename T, typename TKV = T>
struct FmaEngine {
  static constexpr int kT = kTile;  // keys per prefix tile
  const TreeAttentionParams& p;
  const Plan& pl;
  std::vector<float>& qt;  // Qt[d * qs + r], scaled
  std::vector<float>& st;  // St[t][Rp]: scores, then probabilities
  std::vector<float>& kf;  // converted K tile [kTile][D] (bf16 only)
  std::vector<float>& vt;  // converted V tile [kTile][Dp] (bf16, or fp32 with D % VL != 0)
  Task t{};
  int Rp = 0, nrv = 0;
  int64_t qs = 0;
  const TKV* kbase = nullptr;
  const TKV* vbase = nullptr;

  FmaEngine(const TreeAttentionParams& p_, const Plan& pl_, std::vector<float>& qt_, std::vector<float>& st_,
            std::vector<float>& kf_, std::vector<float>& vt_)
      : p(p_), pl(pl_), qt(qt_), st(st_), kf(kf_), vt(vt_) {
    RowState::grow(qt, static_cast<size_t>(pl.D) * (pl.rp_max + VL));
    RowState::grow(st, static_cast<size_t>(kTile) * pl.rp_max);
    RowState::grow(kf, static_cast<size_t>(kTile) * pl.D);
    RowState::grow(vt, static_cast<size_t>(kTile) * pl.Dp);
  }

  void begin(const Task& task) {
    t = task;
    Rp = round_up(t.R, VL);
    nrv = Rp / VL;
    qs = Rp % 64 == 0 ? Rp + VL : Rp;  // off powers of two: Qt rows spread over the cache sets
    const int G = pl.G, D = pl.D;
    const T* q = static_cast<const T*>(p.q);
    float* qtp = qt.data();
    for (int r = 0; r < t.R; ++r) {
      const int ii = r / G, g = r % G;
      const T* row = q + t.b * p.q_stride_b + static_cast<int64_t>(t.kvh * G + g) * p.q_stride_h +
                     static_cast<int64_t>(t.i0 + ii) * p.q_stride_n;
      for (int d = 0; d < D; ++d) qtp[d * qs + r] = to_float<T>(row[d]) * pl.qscale;
    }
    for (int d = 0; d < D; ++d)
      for (int r = t.R; r < Rp; ++r) qtp[d * qs + r] = 0.0f;
    kbase = static_cast<const TKV*>(p.k) + t.b * p.k_stride_b + t.kvh * p.k_stride_h;
    vbase = static_cast<const TKV*>(p.v) + t.b * p.v_stride_b + t.kvh * p.v_stride_h;
  }

  void run(const std::vector<KeyTile>& tiles, RowState& rs) {
    for (const KeyTile& kt : tiles) tile(kt.k0, kt.nk, kt.j0, rs);
  }

  // Keys [k0, k0 + nk); j0 >= 0 marks a tree tile holding tree nodes [j0, j0 + nk).
  void tile(int k0, int nk, int j0, RowState& rs) {
    const int G = pl.G, D = pl.D, Dp = pl.Dp;
    const float* K;
    int64_t ks;
    if constexpr (std::is_same<TKV, float>::value) {
      K = reinterpret_cast<const float*>(kbase) + static_cast<int64_t>(k0) * p.k_stride_l;
      ks = p.k_stride_l;
    } else {
      for (int i = 0; i < nk; ++i)
        bf16_row_to_float(reinterpret_cast<const uint16_t*>(kbase) + static_cast<int64_t>(k0 + i) * p.k_stride_l,
                          kf.data() + static_cast<int64_t>(i) * D, D);
      K = kf.data();
      ks = D;
    }
    const float* V;
    int64_t vs;
    if (std::is_same<TKV, float>::value && D % VL == 0) {
      V = reinterpret_cast<const float*>(vbase) + static_cast<int64_t>(k0) * p.v_stride_l;
      vs = p.v_stride_l;
    } else {
      for (int i = 0; i < nk; ++i) {
        const TKV* src = vbase + static_cast<int64_t>(k0 + i) * p.v_stride_l;
        float* dst = vt.data() + static_cast<int64_t>(i) * Dp;
        if constexpr (std::is_same<TKV, float>::value) {
          std::memcpy(dst, src, sizeof(float) * D);
        } else {
          bf16_row_to_float(reinterpret_cast<const uint16_t*>(src), dst, D);
        }
        for (int d = D; d < Dp; ++d) dst[d] = 0.0f;
      }
      V = vt.data();
      vs = Dp;
    }
    float* St = st.data();
    qk_tile(nk, nrv, K, ks, qt.data(), qs, D, St);  // St[t][r], t < nk

    if (j0 >= 0) {  // tree tile: hide keys that are not ancestors
      const uint64_t full = nk == 64 ? ~uint64_t{0} : (uint64_t{1} << nk) - 1;
      for (int ii = 0; ii < t.nqh; ++ii) {
        const uint64_t wbits = mask_word(p, t.i0 + ii, j0 / 64) >> (j0 % 64);
        if ((wbits & full) == full) continue;
        for (int i = 0; i < nk; ++i) {
          if ((wbits >> i) & 1) continue;
          float* srow = St + static_cast<int64_t>(i) * Rp + ii * G;
          for (int g = 0; g < G; ++g) srow[g] = kNegInf;
        }
      }
    }

    // Online softmax, vectorised over rows: St becomes P = 2^(S - m_new).
    float* M = rs.m.data();
    float* Ls = rs.l.data();
    float* A = rs.alpha.data();
    for (int j = 0; j < nrv; ++j) {
      const vf m_old = loadv(M + j * VL);
      vf mt = splat(kNegInf);
      for (int i = 0; i < nk; ++i) mt = vmax(mt, loadv(St + static_cast<int64_t>(i) * Rp + j * VL));
      const vf m_new = vmax(m_old, mt);
      const vf m_use = m_new == splat(kNegInf) ? splat(0.0f) : m_new;  // a row that saw nothing yet
      vf sum = splat(0.0f);
      for (int i = 0; i < nk; ++i) {
        float* sp = St + static_cast<int64_t>(i) * Rp + j * VL;
        const vf e = exp2v(loadv(sp) - m_use);
        storev(sp, e);
        sum += e;
      }
      const vf alpha = exp2v(m_old - m_use);
      storev(A + j * VL, alpha);
      storev(Ls + j * VL, loadv(Ls + j * VL) * alpha + sum);
      storev(M + j * VL, m_new);
    }
    pv_tile(nk, t.R, St, Rp, V, vs, rs.o.data(), Dp, Dp / VL, A);
  }
};

// ---- the AMX engine: bf16 tiles on Intel AMX (Sapphire Rapids and later) ------------------------------
//
// S = Q.K^T and O += P.V run as bf16 x bf16 -> fp32 tile products (_tile_dpbf16ps); the softmax runs on
// the fp32 scores with AVX-512, row by row (scores row-major, keys along the lanes), and P is rounded to
// bf16 for the P.V product, as GPU flash attention does. K tiles are packed to the VNNI layout by a
// 32-bit transpose (pairs of d), V tiles by interleaving key pairs; Q is packed once per task.
// All eight tile registers are 16 rows x 64 bytes: a 2 x 2 block of 16 x 16 fp32 results.

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TREESPEC_HAVE_AMX 1
constexpr int kAmxTile = 256;  // keys per prefix tile of the AMX engine (tree tiles: one word, 64)
static_assert(kAmxTile % 64 == 0 && kTile == 64, "AMX tiles hold whole ancestor words");

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {  // Linux asks each process to request the AMX register state once
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

void amx_configure() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);
}

// C[NR x 16 rows][NC x 16 cols] (+)= sum over k steps of A[rows][32 bf16] . B[16 pairs][NC x 16 x 2].
// Byte strides: a_ld / b_ld / c_ld between rows; a_kstep / b_kstep between k steps; blocks of 16 rows
// of A and C are 16 * ld apart, blocks of 16 columns of B and C are 64 bytes apart.
template <int NR, int NC>
inline void amx_gemm(const char* a, int64_t a_ld, int64_t a_kstep, const char* b, int64_t b_ld, int64_t b_kstep,
                     int ksteps, char* c, int64_t c_ld, bool accumulate) {
  if (accumulate) {
    _tile_loadd(0, c, c_ld);
    if constexpr (NC == 2) _tile_loadd(1, c + 64, c_ld);
    if constexpr (NR == 2) _tile_loadd(2, c + 16 * c_ld, c_ld);
    if constexpr (NR == 2 && NC == 2) _tile_loadd(3, c + 16 * c_ld + 64, c_ld);
  } else {
    _tile_zero(0);
    if constexpr (NC == 2) _tile_zero(1);
    if constexpr (NR == 2) _tile_zero(2);
    if constexpr (NR == 2 && NC == 2) _tile_zero(3);
  }
  for (int k = 0; k < ksteps; ++k) {
    _tile_loadd(4, a + k * a_kstep, a_ld);
    if constexpr (NR == 2) _tile_loadd(5, a + k * a_kstep + 16 * a_ld, a_ld);
    _tile_loadd(6, b + k * b_kstep, b_ld);
    if constexpr (NC == 2) _tile_loadd(7, b + k * b_kstep + 64, b_ld);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NC == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NR == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (NR == 2 && NC == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, c_ld);
  if constexpr (NC == 2) _tile_stored(1, c + 64, c_ld);
  if constexpr (NR == 2) _tile_stored(2, c + 16 * c_ld, c_ld);
  if constexpr (NR == 2 && NC == 2) _tile_stored(3, c + 16 * c_ld + 64, c_ld);
}

// Blocks of 2 x 2 where possible, then the odd row block / column block.
inline void amx_gemm_blocks(int row_blocks, int col_blocks, const char* a, int64_t a_ld, int64_t a_kstep,
                            const char* b, int64_t b_ld, int64_t b_kstep, int ksteps, char* c, int64_t c_ld,
                            bool accumulate) {
  for (int rb = 0; rb < row_blocks; rb += 2) {
    const bool two_r = rb + 1 < row_blocks;
    const char* ar = a + rb * 16 * a_ld;
    char* cr = c + rb * 16 * c_ld;
    for (int cb = 0; cb < col_blocks; cb += 2) {
      const bool two_c = cb + 1 < col_blocks;
      const char* bc = b + cb * 64;
      char* cc = cr + cb * 64;
      if (two_r && two_c) amx_gemm<2, 2>(ar, a_ld, a_kstep, bc, b_ld, b_kstep, ksteps, cc, c_ld, accumulate);
      else if (two_r) amx_gemm<2, 1>(ar, a_ld, a_kstep, bc, b_ld, b_kstep, ksteps, cc, c_ld, accumulate);
      else if (two_c) amx_gemm<1, 2>(ar, a_ld, a_kstep, bc, b_ld, b_kstep, ksteps, cc, c_ld, accumulate);
      else amx_gemm<1, 1>(ar, a_ld, a_kstep, bc, b_ld, b_kstep, ksteps, cc, c_ld, accumulate);
    }
  }
}

// C[32 rows][col_blocks x 16 cols] = A[32 rows][64 bf16] . B for K = 64 (two k steps), A kept in four tile
// registers for all column blocks: per 16 columns two B loads, four products and two stores (the
// general 2 x 2 blocking reloads A for every second column block). rows2: whether the second 16 rows
// exist.
inline void amx_gemm_k64_a_resident(bool rows2, int col_blocks, const char* a, int64_t a_ld, const char* b,
                                    int64_t b_ld, int64_t b_kstep, char* c, int64_t c_ld) {
  _tile_loadd(4, a, a_ld);
  _tile_loadd(5, a + 64, a_ld);
  if (rows2) {
    _tile_loadd(6, a + 16 * a_ld, a_ld);
    _tile_loadd(7, a + 16 * a_ld + 64, a_ld);
  }
  for (int cb = 0; cb < col_blocks; ++cb) {
    const char* bc = b + cb * 64;
    char* cc = c + cb * 64;
    _tile_loadd(2, bc, b_ld);
    _tile_loadd(3, bc + b_kstep, b_ld);
    _tile_zero(0);
    _tile_dpbf16ps(0, 4, 2);
    _tile_dpbf16ps(0, 5, 3);
    if (rows2) {
      _tile_zero(1);
      _tile_dpbf16ps(1, 6, 2);
      _tile_dpbf16ps(1, 7, 3);
      _tile_stored(1, cc + 16 * c_ld, c_ld);
    }
    _tile_stored(0, cc, c_ld);
  }
}

// In-register transpose of a 16 x 16 block of 32-bit values.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int a = 0; a < 4; ++a) {  // rows 4a..4a+3; u[4a + c] lane l = column 4l + c
    u[4 * a + 0] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
    u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i x2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);
    const __m512i y2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
    r[c] = _mm512_shuffle_i32x4(x1, x2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x1, x2, 0xdd);
    r[8 + c] = _mm512_shuffle_i32x4(y1, y2, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(y1, y2, 0xdd);
  }
}

// 2^x for x <= 0 in the kept lanes (finite there), exactly 0 in the other lanes whatever they hold
// (the maskz scalef): round-to-nearest range reduction, a degree-3 polynomial on [-0.5, 0.5] (relative
// error 7.5e-5, well under the bf16 rounding of P that follows), and scalef for the 2^integer factor
// (which also flushes x < -149 to 0).
inline __m512 exp2_masked(__m512 x, __mmask16 keep) {
  const __m512 r = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, r);
  __m512 p = _mm512_set1_ps(5.5181488235518335e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.426119551777007e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.932591800557928e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.99927971385868e-1f));
  return _mm512_maskz_scalef_ps(keep, p, r);
}

struct AmxEngine {
  static constexpr int kT = kAmxTile;  // keys per prefix tile (tree tiles: up to 64)
  const TreeAttentionParams& p;
  const Plan& pl;
  std::vector<uint16_t>& qb;  // Q rows [R16][D] bf16 (unscaled)
  std::vector<uint16_t>& pb;  // P rows [R16][kT] bf16
  std::vector<float>& sc;     // scores, two buffers of [R16][kT] fp32
  std::vector<uint32_t>& kv;  // K^T in VNNI pairs, two buffers of [D / 2][kT]
  std::vector<uint32_t>& vv;  // V in VNNI pairs, two buffers of [kT / 2][D]
  Task t{};
  int R16 = 0;
  const uint16_t* kbase = nullptr;
  const uint16_t* vbase = nullptr;

  AmxEngine(const TreeAttentionParams& p_, const Plan& pl_, std::vector<uint16_t>& qb_, std::vector<uint16_t>& pb_,
            std::vector<float>& sc_, std::vector<uint32_t>& kv_, std::vector<uint32_t>& vv_)
      : p(p_), pl(pl_), qb(qb_), pb(pb_), sc(sc_), kv(kv_), vv(vv_) {
    RowState::grow(qb, static_cast<size_t>(pl.rp_max) * pl.D);
    RowState::grow(pb, static_cast<size_t>(pl.rp_max) * kT);
    RowState::grow(sc, 2 * static_cast<size_t>(pl.rp_max) * kT);
    RowState::grow(kv, 2 * static_cast<size_t>(pl.D / 2) * kT);
    RowState::grow(vv, 2 * static_cast<size_t>(kT / 2) * pl.D);
  }

  uint32_t* kv_buf(int i) { return kv.data() + (i & 1) * static_cast<int64_t>(pl.D / 2) * kT; }
  uint32_t* vv_buf(int i) { return vv.data() + (i & 1) * static_cast<int64_t>(kT / 2) * pl.D; }
  float* sc_buf(int i) { return sc.data() + (i & 1) * static_cast<int64_t>(pl.rp_max) * kT; }

  void begin(const Task& task) {
    t = task;
    R16 = round_up(t.R, 16);
    const int G = pl.G, D = pl.D;
    const uint16_t* q = static_cast<const uint16_t*>(p.q);
    for (int r = 0; r < t.R; ++r) {
      const int ii = r / G, g = r % G;
      const uint16_t* row = q + t.b * p.q_stride_b + static_cast<int64_t>(t.kvh * G + g) * p.q_stride_h +
                            static_cast<int64_t>(t.i0 + ii) * p.q_stride_n;
      std::memcpy(qb.data() + static_cast<int64_t>(r) * D, row, sizeof(uint16_t) * D);
    }
    std::fill(qb.data() + static_cast<int64_t>(t.R) * D, qb.data() + static_cast<int64_t>(R16) * D, 0);
    std::fill(pb.data() + static_cast<int64_t>(t.R) * kT, pb.data() + static_cast<int64_t>(R16) * kT, 0);
    kbase = static_cast<const uint16_t*>(p.k) + t.b * p.k_stride_b + t.kvh * p.k_stride_h;
    vbase = static_cast<const uint16_t*>(p.v) + t.b * p.v_stride_b + t.kvh * p.v_stride_h;
  }

  void pack_k(const KeyTile& kt, uint32_t* dst) {  // dst[p][key] = (K[key][2p], K[key][2p + 1]); pad keys 0
    const int pairs = pl.D / 2;
    for (int tb = 0; tb < kt.nk; tb += 16) {
      const int rows = std::min(16, kt.nk - tb);
      for (int pb0 = 0; pb0 < pairs; pb0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = i < rows ? _mm512_loadu_si512(kbase + static_cast<int64_t>(kt.k0 + tb + i) * p.k_stride_l + 2 * pb0)
                          : _mm512_setzero_si512();
        transpose16(r);
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + static_cast<int64_t>(pb0 + j) * kT + tb, r[j]);
      }
    }
  }

  void pack_v(const KeyTile& kt, uint32_t* dst) {  // dst[q][d] = (V[2q][d], V[2q + 1][d]); pad keys 0
    const int D = pl.D;
    alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
    const int pairs = round_up(kt.nk, 32) / 2;
    for (int q = 0; q < pairs; ++q) {
      const int t0 = 2 * q, t1 = 2 * q + 1;
      const uint16_t* r0 = vbase + static_cast<int64_t>(kt.k0 + t0) * p.v_stride_l;
      const uint16_t* r1 = vbase + static_cast<int64_t>(kt.k0 + t1) * p.v_stride_l;
      uint32_t* row = dst + static_cast<int64_t>(q) * D;
      for (int d = 0; d < D; d += 32) {
        const __m512i a = t0 < kt.nk ? _mm512_loadu_si512(r0 + d) : _mm512_setzero_si512();
        const __m512i b = t1 < kt.nk ? _mm512_loadu_si512(r1 + d) : _mm512_setzero_si512();
        _mm512_storeu_si512(row + d, _mm512_permutex2var_epi16(a, lo, b));
        _mm512_storeu_si512(row + d + 16, _mm512_permutex2var_epi16(a, hi, b));
      }
    }
  }

  // S[r][key] = Q[r] . K[key]  (A: Q rows, 32 d per step; B: K^T pairs, 16 keys per block)
  void qk(const KeyTile& kt, const uint32_t* kvp, float* scp) {
    if (pl.D == 64) {  // Q fits four tile registers: keep it there (about 5% faster than 2 x 2 blocks)
      const int row_blocks = R16 / 16, col_blocks = (kt.nk + 15) / 16;
      for (int rb = 0; rb < row_blocks; rb += 2)
        amx_gemm_k64_a_resident(rb + 1 < row_blocks, col_blocks,
                                reinterpret_cast<const char*>(qb.data() + static_cast<int64_t>(rb) * 16 * 64), 128,
                                reinterpret_cast<const char*>(kvp), 4 * kT, 16 * 4 * kT,
                                reinterpret_cast<char*>(scp + static_cast<int64_t>(rb) * 16 * kT), 4 * kT);
      return;
    }
    amx_gemm_blocks(R16 / 16, (kt.nk + 15) / 16, reinterpret_cast<const char*>(qb.data()), 2 * pl.D, 64,
                    reinterpret_cast<const char*>(kvp), 4 * kT, 16 * 4 * kT, pl.D / 32,
                    reinterpret_cast<char*>(scp), 4 * kT, false);
  }

  // O[r][d] += P[r] . V[:, d]  (A: P rows, 32 keys per step; B: V pairs, 16 d per block)
  void pv(const KeyTile& kt, const uint32_t* vvp, RowState& rs) {
    amx_gemm_blocks(R16 / 16, pl.D / 16, reinterpret_cast<const char*>(pb.data()), 2 * kT, 64,
                    reinterpret_cast<const char*>(vvp), 4 * pl.D, 16 * 4 * pl.D, (kt.nk + 31) / 32,
                    reinterpret_cast<char*>(rs.o.data()), 4 * pl.Dp, true);
  }

  // Online softmax row by row, P rounded to bf16. Lazy rescaling: the reference max M[r] moves only
  // when a tile's max exceeds it by more than kRescale (log2 units), so P <= 2^kRescale and O is
  // rarely rewritten between the tile products (an AMX load right after vector stores to the same
  // lines is slow).
  void softmax(const KeyTile& kt, const float* scp, RowState& rs) {
    constexpr float kRescale = 8.0f;
    const int G = pl.G, D = pl.D, Dp = pl.Dp, nk = kt.nk;
    const __m512 qscale = _mm512_set1_ps(pl.qscale);
    const int chunks = (nk + 31) / 32 * 2;  // P columns the P.V product reads (the padding gets 0)
    float* M = rs.m.data();
    float* Ls = rs.l.data();
    __mmask16 valid[kT / 16];
    for (int c = 0; c < chunks; ++c) {
      const int lo = 16 * c;
      valid[c] = nk >= lo + 16 ? __mmask16(0xffff) : nk > lo ? __mmask16((1u << (nk - lo)) - 1) : __mmask16(0);
    }
    for (int r = 0; r < t.R; ++r) {
      const uint64_t word = kt.j0 >= 0 ? mask_word(p, t.i0 + r / G, kt.j0 / 64) >> (kt.j0 % 64) : ~uint64_t{0};
      const float* srow = scp + static_cast<int64_t>(r) * kT;
      __m512 mx = _mm512_set1_ps(kNegInf);
      for (int c = 0; c < chunks; ++c) {
        const __mmask16 k = valid[c] & static_cast<__mmask16>(word >> (16 * (c & 3)));
        mx = _mm512_mask_max_ps(mx, k, mx, _mm512_loadu_ps(srow + 16 * c));
      }
      const float m_tile = _mm512_reduce_max_ps(mx) * pl.qscale;  // qscale > 0
      const float m_old = M[r];
      if (m_tile > m_old + kRescale || (m_old == kNegInf && m_tile != kNegInf)) {
        if (m_old != kNegInf) {  // O and the sum hold 2^(s - m_old) terms: rescale to m_tile
          const float alpha = std::exp2(m_old - m_tile);
          Ls[r] *= alpha;
          float* orow = rs.o.data() + static_cast<int64_t>(r) * Dp;
          const __m512 a = _mm512_set1_ps(alpha);
          for (int d = 0; d < D; d += 16) _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), a));
        }
        M[r] = m_tile;
      }
      const __m512 mu = _mm512_set1_ps(M[r] == kNegInf ? 0.0f : M[r]);
      __m512 sum = _mm512_setzero_ps();
      uint16_t* prow = pb.data() + static_cast<int64_t>(r) * kT;
      for (int c = 0; c < chunks; ++c) {
        const __mmask16 k = valid[c] & static_cast<__mmask16>(word >> (16 * (c & 3)));
        const __m512 e = exp2_masked(_mm512_fmsub_ps(_mm512_loadu_ps(srow + 16 * c), qscale, mu), k);
        sum = _mm512_add_ps(sum, e);
        const __m256bh h = _mm512_cvtneps_pbh(e);
        std::memcpy(prow + 16 * c, &h, 32);
      }
      Ls[r] += _mm512_reduce_add_ps(sum);
    }
  }

  // Software pipeline over the tiles: while tile i is in the softmax, tile i + 1 is packed and its
  // scores computed, so no AMX load reads lines that vector stores have just written.
  void run(const std::vector<KeyTile>& tiles, RowState& rs) {
    const int count = static_cast<int>(tiles.size());
    if (count == 0) return;
    pack_k(tiles[0], kv_buf(0));
    pack_v(tiles[0], vv_buf(0));
    qk(tiles[0], kv_buf(0), sc_buf(0));
    for (int i = 0; i < count; ++i) {
      if (i + 1 < count) {
        pack_k(tiles[i + 1], kv_buf(i + 1));
        pack_v(tiles[i + 1], vv_buf(i + 1));
      }
      softmax(tiles[i], sc_buf(i), rs);
      if (i + 1 < count) qk(tiles[i + 1], kv_buf(i + 1), sc_buf(i + 1));
      pv(tiles[i], vv_buf(i), rs);
    }
  }
};

bool amx_enabled(const TreeAttentionParams& p) {
  if (p.dtype != DType::kBFloat16 || p.head_dim % 32 != 0) return false;
  const char* env = std::getenv("TREESPEC_CPU_AMX");  // "0": the FMA engine (for tests, comparisons)
  if (env != nullptr && env[0] == '0') return false;
  return amx_permitted();
}
#else
bool amx_enabled(const TreeAttentionParams&) { return false; }
#endif  // AMX

// ---- tasks ---------------------------------------------------------------------------------------------

// What the tasks of one call share when the prefix is split: the partial results, and per
// (batch, kv head, query tile) group the number of its splits still running; the task that finishes
// a group last merges it, inside the same parallel region.
struct Partials {
  std::vector<float> o, ml;
  std::unique_ptr<std::atomic<int>[]> remaining;
};

template <typename T>
void merge_group(const TreeAttentionParams& p, const Plan& pl, int64_t grp, const Partials& part,
                 std::vector<float>& acc) {
  const Task t = task_of(pl, grp * pl.splits);
  const float* part_ml = part.ml.data();
  acc.resize(pl.D);
  for (int r = 0; r < t.R; ++r) {
    float m = kNegInf;
    for (int s = 0; s < pl.splits; ++s) m = std::max(m, part_ml[(grp * pl.splits + s) * 2 * pl.rows_max + r]);
    float l = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int s = 0; s < pl.splits; ++s) {
      const int64_t task = grp * pl.splits + s;
      const float ms = part_ml[task * 2 * pl.rows_max + r];
      if (ms == kNegInf) continue;  // this split saw no key of this row
      const float w = std::exp2(ms - m);
      l += w * part_ml[task * 2 * pl.rows_max + pl.rows_max + r];
      const float* src = part.o.data() + (task * pl.rows_max + r) * static_cast<int64_t>(pl.Dp);
      for (int d = 0; d < pl.D; ++d) acc[d] += w * src[d];
    }
    const float inv = 1.0f / l;
    const int ii = r / pl.G, g = r % pl.G;
    T* orow = static_cast<T*>(p.out) + ((static_cast<int64_t>(t.b) * pl.n + t.i0 + ii) * pl.H + t.kvh * pl.G + g) * pl.D;
    for (int d = 0; d < pl.D; ++d) orow[d] = from_float<T>(acc[d] * inv);
  }
}

template <typename T, typename Engine>
void run_task(const TreeAttentionParams& p, const Plan& pl, int64_t task, Engine& e, RowState& rs,
              std::vector<KeyTile>& tiles, Partials& part, std::vector<float>& acc) {
  const Task t = task_of(pl, task);
  const int G = pl.G, D = pl.D, Dp = pl.Dp, R = t.R;
  float* M = rs.m.data();
  float* Ls = rs.l.data();
  float* O = rs.o.data();
  std::fill(M, M + pl.rp_max, kNegInf);
  std::fill(Ls, Ls + pl.rp_max, 0.0f);
  std::fill(O, O + static_cast<int64_t>(pl.rp_max) * Dp, 0.0f);
  e.begin(t);

  // The committed prefix: this split's tiles.
  tiles.clear();
  const int t_begin = t.split * pl.split_tiles * kTile;
  const int t_end = std::min(pl.c, (t.split + 1) * pl.split_tiles * kTile);
  for (int k0 = t_begin; k0 < t_end; k0 += Engine::kT) tiles.push_back({k0, std::min(Engine::kT, t_end - k0), -1});

  // The tree block (last split only), tiled from c so a tile lies inside one ancestor word; tiles
  // that no row of this task sees are skipped.
  if (t.split == pl.splits - 1) {
    for (int j0 = 0; j0 < pl.n; j0 += kTile) {
      const int nk = std::min(kTile, pl.n - j0);
      uint64_t any = 0;
      for (int ii = 0; ii < t.nqh; ++ii) any |= mask_word(p, t.i0 + ii, j0 / 64) >> (j0 % 64);
      if (nk < 64) any &= (uint64_t{1} << nk) - 1;
      if (any) tiles.push_back({pl.c + j0, nk, j0});
    }
  }
  e.run(tiles, rs);

  if (pl.splits == 1) {  // normalise and write [B, n, H, D]
    T* out = static_cast<T*>(p.out);
    for (int r = 0; r < R; ++r) {
      const int ii = r / G, g = r % G;
      const float inv = 1.0f / Ls[r];
      T* orow = out + ((static_cast<int64_t>(t.b) * pl.n + t.i0 + ii) * pl.H + t.kvh * G + g) * D;
      const float* src = O + static_cast<int64_t>(r) * Dp;
      for (int d = 0; d < D; ++d) orow[d] = from_float<T>(src[d] * inv);
    }
  } else {  // partial results; the last split of the group to finish merges them
    std::memcpy(part.o.data() + task * static_cast<int64_t>(pl.rows_max) * Dp, O, sizeof(float) * R * Dp);
    float* ml = part.ml.data() + task * 2 * static_cast<int64_t>(pl.rows_max);
    std::memcpy(ml, M, sizeof(float) * R);
    std::memcpy(ml + pl.rows_max, Ls, sizeof(float) * R);
    const int64_t grp = task / pl.splits;
    if (part.remaining[grp].fetch_sub(1, std::memory_order_acq_rel) == 1) merge_group<T>(p, pl, grp, part, acc);
  }
}

// Per-thread buffers, kept across calls (decoding calls the op thousands of times).
struct ThreadBuffers {
  RowState rs;
  std::vector<KeyTile> tiles;
  std::vector<float> f0, f1, f2, f3, acc;
  std::vector<uint16_t> h0, h1;
  std::vector<uint32_t> u0, u1;
};

template <typename T, typename TKV = T>
void run(const TreeAttentionParams& p) {
  const int threads = p.serial ? 1 : at::get_num_threads();
  const Plan pl = make_plan(p, threads, std::is_same<T, uint16_t>::value && amx_enabled(p));
  Partials part;
  if (pl.splits > 1) {
    part.o.resize(static_cast<size_t>(pl.tasks) * pl.rows_max * pl.Dp);
    part.ml.resize(static_cast<size_t>(pl.tasks) * 2 * pl.rows_max);
    const int64_t groups = pl.tasks / pl.splits;
    part.remaining.reset(new std::atomic<int>[groups]);
    for (int64_t g = 0; g < groups; ++g) part.remaining[g].store(pl.splits, std::memory_order_relaxed);
  }
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(threads, pl.tasks);
  auto worker = [&](int64_t, int64_t) {
    thread_local ThreadBuffers buf;
    buf.rs.reserve(pl);
#ifdef TREESPEC_HAVE_AMX
    if constexpr (std::is_same<T, uint16_t>::value) {
      if (pl.amx) {
        AmxEngine e(p, pl, buf.h0, buf.h1, buf.f0, buf.u0, buf.u1);
        amx_configure();
        for (int64_t task = next.fetch_add(1); task < pl.tasks; task = next.fetch_add(1))
          run_task<T>(p, pl, task, e, buf.rs, buf.tiles, part, buf.acc);
        _tile_release();
        return;
      }
    }
#endif
    FmaEngine<T, TKV> e(p, pl, buf.f0, buf.f1, buf.f2, buf.f3);
    for (int64_t task = next.fetch_add(1); task < pl.tasks; task = next.fetch_add(1))
      run_task<T>(p, pl, task, e, buf.rs, buf.tiles, part, buf.acc);
  };
  if (p.serial)
    worker(0, 1);
  else
    at::parallel_for(0, workers, 1, worker);
}

}  // namespace

void tree_attention_cpu(const TreeAttentionParams& p) {
  switch (p.dtype) {
    case DType::kFloat32:
      if (p.kv_bf16)
        run<float, uint16_t>(p);
      else
        run<float>(p);
      break;
    case DType::kBFloat16: run<uint16_t>(p); break;
    default: break;  // the binding rejects other dtypes
  }
}

void commit_kv_cpu(const CommitParams& p) {
  if (p.moves == 0 || p.num_tensors == 0) return;
  const int64_t heads = static_cast<int64_t>(p.batch) * p.kv_heads;
  const int64_t rows = p.num_tensors * heads;
  const size_t row_bytes = static_cast<size_t>(p.head_dim) * p.element_size;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, p.moves * row_bytes));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t t = idx / heads, bh = idx % heads;
      const int64_t b = bh / p.kv_heads, h = bh % p.kv_heads;
      char* base = static_cast<char*>(p.tensors[t]) + (b * p.stride_b + h * p.stride_h) * p.element_size;
      for (int i = 0; i < p.moves; ++i) {  // in order: a move may read what an earlier one wrote
        char* dst = base + p.dst[i] * p.stride_l * p.element_size;
        const char* src = base + p.src[i] * p.stride_l * p.element_size;
        if (dst != src) std::memmove(dst, src, row_bytes);
      }
    }
  });
}

}  // namespace treespec
