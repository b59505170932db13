// The native decoding step (native_step.h): one OpenMP parallel region runs every layer of a Llama-family
// decoder for the [A, n] tokens of a step, as stages of tasks (`run_stages`):
//
//   embed | per layer: norm | q,k,v columns | rotary + cache write | attention (row, kv head) | o columns
//         + residual | norm | gate,up columns + silu * up | down columns + residual | final norm
//
// Linear stages split the output columns into tasks of kTaskColumns; every task runs every row of the
// step (the weights are read once per step, whatever the row count).

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>

#include "argmax.h"
#include "exact.h"
#include "native_step.h"
#include "tree_attention.h"
#include "vec.h"

namespace treespec {
namespace {

constexpr int64_t kTaskColumns = 32;
constexpr int64_t kWideTaskColumns = 64;  // ... for steps of at most kWideRows (int8: kWideRowsInt8) rows
constexpr int64_t kWideRows = 2;
// int8 up to 4 rows (small trees): with 64 columns a task's columns are whole heads, so rotary runs in the
// q/k/v tasks (no rotary stage). On the 2-core Zen 3 EPYC (the setting alternated, three runs of
// scripts/step_profile.py each) int8 steps of 3 / 4 nodes cost ~3% less than with 32 columns, while the
// linears of float32 4-node steps (compute-bound float kernels: 9 tasks of 64 columns balance worse on 2
// threads) cost 3-14% more.
constexpr int64_t kWideRowsInt8 = 4;
constexpr int kQueryTile = 8;  // query tokens per attention task of the row-invariant kernel
// ... and of the fast kernel over a causal block longer than this (a prompt's prefill): whole key tiles of
// the kernel (64), so each tile's keys and their order are those of one task over the whole block
constexpr int kCausalQueryTile = 64;

inline float round_to(float x, bool bf16) { return bf16 ? bf16_to_float(float_to_bf16(x)) : x; }

inline void round_row(float* x, int64_t n, bool bf16) {
  if (!bf16) return;
  for (int64_t i = 0; i < n; ++i) x[i] = bf16_to_float(float_to_bf16(x[i]));
}

// out[d] = w[d] * (h[d] / sqrt(mean(h^2) + eps)), as LlamaRMSNorm computes it (bf16: the normalised value
// and the product rounded to bf16, as the module's `.to(input_dtype)` and bf16 product do)
inline void rms_norm(const float* h, const float* w, int H, float eps, bool bf16, float* out) {
  vf acc = splat(0.0f);
  int d = 0;
  for (; d + VL <= H; d += VL) {
    const vf v = loadv(h + d);
    acc += v * v;
  }
  float ss = lane_sum(acc);
  for (; d < H; ++d) ss += h[d] * h[d];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (d = 0; d < H; ++d) out[d] = round_to(w[d] * round_to(h[d] * inv, bf16), bf16);
}

// The rotary embedding of one head vector x [D] in place: x * cos + rotate_half(x) * sin. Neither inlined
// nor cloned: it is called from the q/k/v tasks (steps of few rows) and from the rotary stage (more rows),
// and one compiled body keeps the compiler's choice to fuse its multiply-add or not the same for both.
__attribute__((noinline, noclone)) void rotate(float* x, const float* cos, const float* sin, int D, bool bf16) {
  const int half = D / 2;
  float tmp[512];
  for (int d = 0; d < D; ++d) {
    const float rot = d < half ? -x[d + half] : x[d - half];
    tmp[d] = round_to(round_to(x[d] * cos[d], bf16) + round_to(rot * sin[d], bf16), bf16);
  }
  std::memcpy(x, tmp, sizeof(float) * D);
}

// s[i] = silu(g[i]) for i < VL * vectors (vec.h `silu`). Every caller runs this one compiled body (not
// inlined, not cloned, like `rotate`), so a lane's result depends only on its value.
__attribute__((noinline, noclone)) void silu_vectors(const float* g, float* s, int64_t vectors) {
  for (int64_t v = 0; v < vectors; ++v) storev(s + VL * v, silu(loadv(g + VL * v)));
}

// out[j] = silu(g[j]) * u[j] for j < count (bf16 models: g, u, the silu and the product rounded to bf16, as
// HF's bf16 tensors hold them). float32: whole vectors straight from g into out, then the products (the
// per-element copies of the bf16 path cost ~3.5 ns an element, ~5% of an int8 prefill); a last partial vector
// and bf16 rows go through a VL-lane buffer (lanes past count compute on zeros).
inline void silu_times(const float* g, const float* u, float* out, int64_t count, bool bf16) {
  int64_t j = 0;
  if (!bf16) {
    j = count / VL * VL;
    silu_vectors(g, out, j / VL);
    for (int64_t i = 0; i < j; ++i) out[i] *= u[i];
  }
  for (; j < count; j += VL) {
    const int64_t k = std::min<int64_t>(VL, count - j);
    float gb[VL] = {}, sb[VL];
    for (int64_t i = 0; i < k; ++i) gb[i] = round_to(g[j + i], bf16);
    silu_vectors(gb, sb, 1);
    for (int64_t i = 0; i < k; ++i) out[j + i] = round_to(round_to(sb[i], bf16) * round_to(u[j + i], bf16), bf16);
  }
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i]);
}

// The stages of a step, in order; a stage's tasks run once every task of the stage before has finished.
// (the order of NATIVE_STAGE_KINDS in native_bindings.cpp)
enum class StageKind : int { kEmbed, kNorm1, kQKV, kRotary, kAttention, kO, kNorm2, kGateUp, kDown, kFeatures, kFinal, kLogits };

struct Stage {
  StageKind kind;
  int layer;
  int64_t tasks;
};

// Runs every task of every stage on the threads of one parallel region. Tasks are claimed in stage order
// from one counter, in runs of consecutive tasks of one stage ("guided": a claim takes the stage's
// remaining tasks / (2 x threads), at least one), so a stage of many small tasks (a one-row step's linears:
// 64 columns each) costs a few claims per thread instead of one shared-counter round trip per task, and a
// thread streams longer runs of consecutive weight panels; the last claims of a stage are single tasks, so
// the threads still finish together. A thread that claims tasks of stage s first waits until stage s - 1
// has completed (a count of finished tasks, not of arrived threads), so a thread that comes late finds the
// work taken and leaves at once. A thread that another process keeps off its core still holds up the
// tasks it holds: `ThreadGovernor` sees those waits and runs the next steps on fewer threads while they last.
// profile: nullptr, or kNativeStageKinds nanosecond counters that each task's time is added to (by kind).
template <class Run>
void run_stages(const std::vector<Stage>& stages, Run run, ThreadGovernor* governor, int64_t* profile = nullptr) {
  const size_t S = stages.size();
  std::vector<int64_t> end(S);
  int64_t total = 0;
  for (size_t s = 0; s < S; ++s) end[s] = total += stages[s].tasks;
  std::unique_ptr<std::atomic<int64_t>[]> done(new std::atomic<int64_t>[S]);
  for (size_t s = 0; s < S; ++s) done[s].store(0, std::memory_order_relaxed);
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> waited_ns{0};
  const int threads = governor != nullptr ? governor->threads() : omp_get_max_threads();
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  {
    size_t s = 0;
    int64_t waited = 0;
    for (;;) {
      // claim tasks [g, g + count) of one stage
      int64_t g = next.load(std::memory_order_relaxed), count = 1;
      for (;;) {
        if (g >= total) break;
        while (g >= end[s]) ++s;
        count = std::max<int64_t>(1, (end[s] - g) / (2 * threads));
        if (next.compare_exchange_weak(g, g + count, std::memory_order_relaxed)) break;
      }
      if (g >= total) break;
      while (g >= end[s]) ++s;
      if (s > 0 && done[s - 1].load(std::memory_order_acquire) < stages[s - 1].tasks) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int spins = 0; done[s - 1].load(std::memory_order_acquire) < stages[s - 1].tasks; ++spins) {
          if (spins < 2048)
            _mm_pause();
          else
            std::this_thread::yield();  // the task we wait for may need this core
        }
        waited += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
      }
      const int64_t first = g - (end[s] - stages[s].tasks);
      if (profile != nullptr) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t t = first; t < first + count; ++t) run(stages[s], t);
        const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0);
        __atomic_fetch_add(profile + static_cast<int>(stages[s].kind), static_cast<int64_t>(ns.count()), __ATOMIC_RELAXED);
      } else {
        for (int64_t t = first; t < first + count; ++t) run(stages[s], t);
      }
      done[s].fetch_add(count, std::memory_order_release);
    }
    waited_ns.fetch_add(waited, std::memory_order_relaxed);
  }
  if (governor != nullptr) {
    const double wall = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
    governor->record(threads, waited_ns.load() / (wall * threads + 1.0));
  }
}

template <typename T>
void step(const NativeModelDesc& m, const NativeStepArgs& a, NativeScratch& s) {
  const bool bf16 = m.bf16;
  const int A = a.A, n = a.n, H = m.hidden, Hq = m.heads, Hkv = m.kv_heads, D = m.head_dim, G = Hq / Hkv;
  const int64_t M = static_cast<int64_t>(A) * n, I = m.intermediate;
  const int64_t qw = static_cast<int64_t>(Hq) * D, kw = static_cast<int64_t>(Hkv) * D, QKV = qw + 2 * kw;
  s.h.resize(M * H);
  s.x.resize(M * H);
  if (m.eagle) s.u.resize(M * 2 * H);
  s.qkv.resize(M * QKV);
  s.attn.resize(M * qw);
  s.o.resize(M * H);
  s.gate.resize(M * I);
  s.up.resize(M * I);
  s.act.resize(M * I);
  std::vector<T>* qbuf;
  std::vector<T>* obuf;
  if constexpr (std::is_same<T, uint16_t>::value) {
    qbuf = &s.q_bf16;
    obuf = &s.out_bf16;
  } else {
    qbuf = &s.q_f32;
    obuf = &s.out_f32;
  }
  if (m.int8) {
    s.xq.resize(M, H);
    s.attnq.resize(M, qw);
    s.actq.resize(M, I);
  }
  qbuf->resize(M * qw);  // [A, Hq, n, D]
  obuf->resize(M * qw);  // [A, Hkv, n, G, D]
  T* qh = qbuf->data();
  T* oh = obuf->data();
  float* h = s.h.data();
  float* x = s.x.data();
  float* qkv = s.qkv.data();
  float* attn = s.attn.data();
  float* o = s.o.data();
  const int64_t F = static_cast<int64_t>(a.num_features) * H;
  auto copy_feature = [&](int index, const float* src, int64_t r) {  // src: one row [H]
    for (int f = 0; f < a.num_features; ++f)
      if (a.feature_layers[f] == index) store_row<T>(src, static_cast<T*>(a.features) + r * F + f * H, H);
  };
  // columns per linear task: wider for the few rows of a plain step or a small tree (longer weight streams
  // per task, fewer tasks to hand out), kTaskColumns otherwise. No output depends on it (the kernels are
  // row-invariant whichever columns a call covers).
  const int64_t task_columns = M <= (m.int8 ? kWideRowsInt8 : kWideRows) ? kWideTaskColumns : kTaskColumns;
  auto column_tasks = [&](int64_t N) { return (N + task_columns - 1) / task_columns; };
  // the q, k, v columns as one stage: task t covers columns of q, then k, then v
  const int64_t q_tasks = column_tasks(qw), k_tasks = column_tasks(kw);
  // where a task's columns are whole heads (a plain step: 64 columns, head_dim 64 or 32), the task also
  // applies the rotary embedding to them and stores them for attention / into the cache, and the step has
  // no rotary stage (one barrier and one single-task stage less per layer). The same operations per row
  // and head either way.
  const bool fused_rotary = task_columns % D == 0;

  // attention tasks: (row, kv head) for the fast kernel; (row, kv head, tile of kQueryTile tokens) for the
  // row-invariant one, whose result per token does not depend on how the queries are split. The
  // row-invariant kernel also serves fast numerics when a task has few query rows (n tokens x G heads):
  // the fast kernel lays the rows along the vector lanes and leaves most of them empty, the row-invariant
  // one fills them with head dims. Measured on AVX2 (8 lanes, one thread, after 1024 keys): 3 rows 119 vs
  // 148 us, 6 rows 147 vs 189, 4 rows (D 64) 296 vs 394 and (D 128) 683 vs 921; 7 rows 153 vs 136, 8 rows
  // 625 vs 443. So up to VL - 2 rows. The same rule for 16 lanes: on a Zen 4 EPYC the fast kernel's one- and
  // two-token steps took 1.3-1.6x the attention time of the row-invariant one (prefix 128 and 700).
  // (tokens past the start of their block: the row-invariant kernel, the one that takes a query offset)
  const bool exact_attention = a.exact || n * G <= VL - 2 || a.block_offset > 0;
  const int block_n = a.block_offset + n;  // the block's tokens up to this call's last
  const float* qkv_input = m.eagle ? s.u.data() : x;  // [M, K] the q / k / v linears' input
  // A causal block (no ancestor bits: a prompt) through the fast kernel splits into tiles of
  // kCausalQueryTile tokens, each over the keys up to its last token: every token before the tile is then
  // prefix to it, its key tiles those of one task over the block (from a cache holding a multiple of 64
  // tokens, e.g. none, the same bits). One task per KV head left a thread idle (SmolLM2: 3 tasks for 2
  // threads): on the 2-core Zen 4 EPYC an int8 prefill of 768 tokens took 505-583 ms against 548-560 (the
  // fastest of five, three runs alternated), its attention tasks 140-147 ms against 152-164.
  const bool causal_tiles = !exact_attention && a.bits == nullptr && n > kCausalQueryTile;
  const int query_tile = exact_attention ? kQueryTile : (causal_tiles ? kCausalQueryTile : n);
  const int query_tiles = (n + query_tile - 1) / query_tile;
  std::vector<Stage> stages;
  stages.push_back({StageKind::kEmbed, 0, M});
  for (int l = 0; l < m.layers; ++l) {
    if (!m.eagle) stages.push_back({StageKind::kNorm1, l, M});  // (eagle: the embed stage builds u)
    stages.push_back({StageKind::kQKV, l, q_tasks + 2 * k_tasks});
    if (!fused_rotary) stages.push_back({StageKind::kRotary, l, M});
    stages.push_back({StageKind::kAttention, l, static_cast<int64_t>(A) * Hkv * query_tiles});
    stages.push_back({StageKind::kO, l, column_tasks(H)});
    stages.push_back({StageKind::kNorm2, l, M});
    stages.push_back({StageKind::kGateUp, l, column_tasks(I)});
    stages.push_back({StageKind::kDown, l, column_tasks(H)});
    if (a.num_features > 0 && l + 1 < m.layers) stages.push_back({StageKind::kFeatures, l + 1, M});
  }
  stages.push_back({StageKind::kFinal, 0, M});

  auto columns = [&](int64_t t, int64_t N) { return std::make_pair(t * task_columns, std::min(N, (t + 1) * task_columns)); };
  // one linear's columns [n0, n1) over M rows: the float kernels, or int8_linear.h's over the rows' int8 form
  auto linear = [&](const LinearWeights& w, const Int8Weights& iw, const float* in, const QuantRows& qin, float* out,
                    int64_t ldo, int64_t n0, int64_t n1) {
    if (m.int8)
      int8_columns(iw, qin, M, out, ldo, n0, n1);
    else
      linear_columns(w, in, M, out, ldo, n0, n1);
  };
  auto residual = [&](const float* out, int64_t n0, int64_t n1) {  // h += out over columns [n0, n1)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t j = n0; j < n1; ++j) h[r * H + j] = round_to(h[r * H + j] + round_to(out[r * H + j], bf16), bf16);
  };

  // row r's q head `head`: rotary, then stored for attention
  auto rotary_q = [&](const NativeLayer& L, int64_t r, int head) {
    const int64_t ai = r / n, i = r % n, pos = a.positions[r];
    float* qv = qkv + r * QKV + static_cast<int64_t>(head) * D;
    if (L.q_norm) rms_norm(qv, L.q_norm, D, m.eps, bf16, qv);  // in place: each element read before written
    rotate(qv, a.cos + pos * D, a.sin + pos * D, D, bf16);
    store_row<T>(qv, qh + ((ai * Hq + head) * n + i) * D, D);
  };
  // one head's k or v row into cache slot `slot`, in the cache's element type
  auto store_kv = [&](const float* src, void* cache, int64_t slot) {
    if (m.kv_bf16)
      store_row<uint16_t>(src, static_cast<uint16_t*>(cache) + slot, D);
    else
      store_row<T>(src, static_cast<T*>(cache) + slot, D);
  };
  // row r's kv head `kvh`: rotary on k (rotate_k), then k (store_k) and / or v (store_v) into the cache
  auto rotary_kv = [&](const NativeLayer& L, int64_t r, int kvh, bool store_k, bool store_v) {
    const int64_t ai = r / n, i = r % n, pos = a.positions[r];
    float* row = qkv + r * QKV;
    const int64_t slot =
        a.rows[ai] * m.cache_stride_b + kvh * m.cache_stride_h + (a.starts[ai] + a.block_offset + i) * m.cache_stride_l;
    if (store_k) {
      float* kv = row + qw + static_cast<int64_t>(kvh) * D;
      if (L.k_norm) rms_norm(kv, L.k_norm, D, m.eps, bf16, kv);
      rotate(kv, a.cos + pos * D, a.sin + pos * D, D, bf16);
      store_kv(kv, L.keys, slot);
    }
    if (store_v) store_kv(row + qw + kw + static_cast<int64_t>(kvh) * D, L.values, slot);
  };

  run_stages(stages, [&](const Stage& st, int64_t t) {
    const NativeLayer& L = m.layer[st.layer];
    switch (st.kind) {
      case StageKind::kEmbed: {
        const int64_t id = a.ids[t];
        if (m.eagle) {  // h = the given input; u = [norm(embedding), norm'(input)] (x holds the embedding row)
          std::memcpy(h + t * H, a.inputs + t * H, sizeof(float) * H);
          if (m.bf16 || m.embed_bf16)
            bf16_row_to_float(static_cast<const uint16_t*>(m.embed) + id * H, x + t * H, H);
          else
            std::memcpy(x + t * H, static_cast<const float*>(m.embed) + id * H, sizeof(float) * H);
          rms_norm(x + t * H, L.input_norm, H, m.eps, bf16, s.u.data() + t * 2 * H);
          rms_norm(h + t * H, m.hidden_norm, H, m.eps, bf16, s.u.data() + t * 2 * H + H);
          break;
        }
        if constexpr (std::is_same<T, uint16_t>::value)
          bf16_row_to_float(static_cast<const uint16_t*>(m.embed) + id * H, h + t * H, H);
        else
          std::memcpy(h + t * H, static_cast<const float*>(m.embed) + id * H, sizeof(float) * H);
        copy_feature(0, h + t * H, t);
        break;
      }
      case StageKind::kNorm1:
      case StageKind::kNorm2:
        rms_norm(h + t * H, st.kind == StageKind::kNorm1 ? L.input_norm : L.post_norm, H, m.eps, bf16, x + t * H);
        if (m.int8) quantize_row(x + t * H, s.xq, t);
        break;
      case StageKind::kQKV: {
        const LinearWeights* w = &L.q;
        const Int8Weights* iw = &L.iq;
        int64_t task = t, offset = 0, N = qw;
        if (task >= q_tasks) {
          task -= q_tasks;
          w = task < k_tasks ? &L.k : &L.v;
          iw = task < k_tasks ? &L.ik : &L.iv;
          offset = task < k_tasks ? qw : qw + kw;
          task = task < k_tasks ? task : task - k_tasks;
          N = kw;
        }
        const auto [n0, n1] = columns(task, N);
        linear(*w, *iw, qkv_input, s.xq, qkv + offset, QKV, n0, n1);
        if (bf16)
          for (int64_t r = 0; r < M; ++r) round_row(qkv + offset + r * QKV + n0, n1 - n0, true);
        if (fused_rotary)  // the task's heads [n0 / D, n1 / D) of q, k or v
          for (int64_t r = 0; r < M; ++r)
            for (int head = static_cast<int>(n0 / D); head < n1 / D; ++head) {
              if (offset == 0)
                rotary_q(L, r, head);
              else
                rotary_kv(L, r, head, offset == qw, offset != qw);
            }
        break;
      }
      case StageKind::kRotary: {  // row t: rotary on its q and k heads; k, v into the cache; q for attention
        for (int head = 0; head < Hq; ++head) rotary_q(L, t, head);
        for (int kvh = 0; kvh < Hkv; ++kvh) rotary_kv(L, t, kvh, true, true);
        break;
      }
      case StageKind::kAttention: {  // (row, kv head, query tile) t: its G query heads over the row's keys
        const int64_t ai = t / (Hkv * query_tiles);
        const int kvh = static_cast<int>(t / query_tiles % Hkv);
        const int i0 = static_cast<int>(t % query_tiles) * query_tile, i1 = std::min(n, i0 + query_tile);
        const int tokens = i1 - i0;
        TreeAttentionParams p;
        p.q = qh + ((ai * Hq + static_cast<int64_t>(kvh) * G) * n + i0) * D;
        const int64_t base = a.rows[ai] * m.cache_stride_b + kvh * m.cache_stride_h;
        const int64_t kv_bytes = m.kv_bf16 ? 2 : static_cast<int64_t>(sizeof(T));  // the cache's element size
        p.k = static_cast<const char*>(L.keys) + base * kv_bytes;
        p.v = static_cast<const char*>(L.values) + base * kv_bytes;
        p.kv_bf16 = m.kv_bf16;  // (a float32 model's only: bind_cache)
        T* out = oh + ((ai * Hkv + kvh) * static_cast<int64_t>(n) + i0) * G * D;  // [tokens, G, D] of [n, G, D]
        p.out = out;
        p.bits = a.bits;
        p.q_stride_b = static_cast<int64_t>(Hq) * n * D;
        p.q_stride_h = static_cast<int64_t>(n) * D;
        p.q_stride_n = D;
        p.k_stride_b = p.v_stride_b = m.cache_stride_b;
        p.k_stride_h = p.v_stride_h = m.cache_stride_h;
        p.k_stride_l = p.v_stride_l = m.cache_stride_l;
        p.batch = 1;
        p.heads = G;
        p.kv_heads = 1;
        p.n = tokens;
        p.block_n = block_n;
        p.query_offset = a.block_offset + i0;
        // (the fast kernel: its n queries are the last of its keys, so a causal tile ends its keys)
        p.kv_len = static_cast<int>(a.starts[ai] + (exact_attention ? block_n : i1));
        p.head_dim = D;
        p.words = a.words > 0 ? a.words : (block_n + 63) / 64;
        p.scale = m.scale;
        p.dtype = bf16 ? DType::kBFloat16 : DType::kFloat32;
        p.serial = true;
        if (exact_attention)
          tree_attention_exact_cpu(p);
        else
          tree_attention_cpu(p);
        for (int i = i0; i < i1; ++i)
          for (int g = 0; g < G; ++g) {
            const T* src = out + (static_cast<int64_t>(i - i0) * G + g) * D;
            float* dst = attn + (ai * n + i) * qw + (static_cast<int64_t>(kvh) * G + g) * D;
            for (int d = 0; d < D; ++d) dst[d] = to_float<T>(src[d]);
          }
        if (m.int8) {  // this kv head's G * D outputs of each token are whole blocks of 32 (D % 32 == 0)
          const int64_t b0 = static_cast<int64_t>(kvh) * G * D / 32, b1 = b0 + static_cast<int64_t>(G) * D / 32;
          for (int i = i0; i < i1; ++i) quantize_blocks(attn + (ai * n + i) * qw, s.attnq, ai * n + i, b0, b1);
        }
        break;
      }
      case StageKind::kO: {
        const auto [n0, n1] = columns(t, H);
        linear(L.o, L.io, attn, s.attnq, o, H, n0, n1);
        residual(o, n0, n1);
        break;
      }
      case StageKind::kGateUp: {
        const auto [n0, n1] = columns(t, I);
        linear(L.gate, L.igate, x, s.xq, s.gate.data(), I, n0, n1);
        linear(L.up, L.iup, x, s.xq, s.up.data(), I, n0, n1);
        for (int64_t r = 0; r < M; ++r)
          silu_times(s.gate.data() + r * I + n0, s.up.data() + r * I + n0, s.act.data() + r * I + n0, n1 - n0, bf16);
        if (m.int8)  // the task's columns are whole blocks of 32 (task columns and I are multiples of 32)
          for (int64_t r = 0; r < M; ++r) quantize_blocks(s.act.data() + r * I, s.actq, r, n0 / 32, n1 / 32);
        break;
      }
      case StageKind::kDown: {
        const auto [n0, n1] = columns(t, H);
        linear(L.down, L.idown, s.act.data(), s.actq, o, H, n0, n1);
        residual(o, n0, n1);
        break;
      }
      case StageKind::kFeatures: copy_feature(st.layer, h + t * H, t); break;
      case StageKind::kFinal:
        if (a.outputs != nullptr) store_row<T>(h + t * H, static_cast<T*>(a.outputs) + t * H, H);
        rms_norm(h + t * H, m.final_norm, H, m.eps, bf16, x + t * H);
        store_row<T>(x + t * H, static_cast<T*>(a.hidden) + t * H, H);
        copy_feature(m.layers, x + t * H, t);
        break;
    }
  }, a.governor, a.profile_ns);
}

// Columns [0, N) of out [M, N] in tasks of `columns` on the step's scheduler: columns_of(n0, n1) computes a
// task's columns for every row; with best, the task then takes each row's maximum over them (argmax.h:
// read while the task's core still holds them) and best[r] merges the tasks' in column order.
template <class Columns>
void logits_stage(int64_t M, int64_t N, float* out, int64_t columns, ThreadGovernor* governor, int64_t* profile_ns,
                  int64_t* best, Columns columns_of) {
  const int64_t tasks = (N + columns - 1) / columns;
  std::vector<RowMax> maxima(best != nullptr ? M * tasks : 0);  // [M, tasks]
  const std::vector<Stage> stages = {{StageKind::kLogits, 0, tasks}};
  run_stages(stages, [&](const Stage&, int64_t t) {
    const int64_t n0 = t * columns, n1 = std::min(N, n0 + columns);
    columns_of(n0, n1);
    if (best != nullptr)
      for (int64_t r = 0; r < M; ++r) maxima[r * tasks + t] = row_max(out + r * N, n0, n1);
  }, governor, profile_ns);
  if (best == nullptr) return;
  for (int64_t r = 0; r < M; ++r) {
    RowMax row;
    for (int64_t t = 0; t < tasks; ++t) merge_row_max(row, maxima[r * tasks + t]);
    best[r] = row.index;
  }
}

}  // namespace

void native_linear_cpu(const LinearWeights& w, const float* x, int64_t M, float* out, int64_t columns_per_task,
                       ThreadGovernor* governor, int64_t* profile_ns, int64_t* best) {
  logits_stage(M, w.N, out, columns_per_task, governor, profile_ns, best,
               [&](int64_t n0, int64_t n1) { linear_columns(w, x, M, out, w.N, n0, n1); });
}

void native_int8_linear_cpu(const Int8Weights& w, const float* x, int64_t M, QuantRows& rows, float* out,
                            int64_t columns_per_task, ThreadGovernor* governor, int64_t* profile_ns, int64_t* best) {
  rows.resize(M, w.K);
  for (int64_t r = 0; r < M; ++r) quantize_row(x + r * w.K, rows, r);
  logits_stage(M, w.N, out, columns_per_task, governor, profile_ns, best,
               [&](int64_t n0, int64_t n1) { int8_columns(w, rows, M, out, w.N, n0, n1); });
}

void native_step_cpu(const NativeModelDesc& m, const NativeStepArgs& a, NativeScratch& s) {
  if (m.bf16)
    step<uint16_t>(m, a, s);
  else
    step<float>(m, a, s);
}

}  // namespace treespec
