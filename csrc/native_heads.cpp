// Medusa heads drafting natively (drafters/medusa.py): the custom class `treespec.NativeHeads` holds the heads'
// weight descriptors. Sequential heads (`SequentialDrafter`) draft every level of a static tree for B rows in
// one call (`propose`), where the torch path runs about twenty small operations per level; independent heads
// (`MedusaDrafter`: every head reads the target's hidden state alone) give each head's top-k in one call
// (`head_topk`), their output rows read once for every head.
//
// Level d expands the tree's nodes at depth d that have children (n_d of them, per row):
//   u = before + P_d e(token)            before: the target's hidden (d = 0) or the parent node's u
//   u = u + silu(W u + b)                 for each residual block of head d
//   logits = out u                        [V'] over the draft vocabulary (the target's output rows)
//   children: the top-k of softmax(logits), each child's token (through the draft vocabulary) and probability
// Every linear runs on the block / dense kernels of block_linear.h (or the int8 ones of int8_linear.h), its
// columns shared among the threads of one OpenMP region; the softmax and top-k run per row.
//
// Numerics: float32 sums, so the drafts equal the torch path's up to float rounding (the probabilities to
// ~1e-6; a top-k order can differ only where two logits tie to that precision). Drafts are guesses the
// target verifies, so they never change what is generated, only how fast.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "block_linear.h"
#include "int8_linear.h"
#include "linear_slots.h"
#include "vec.h"

namespace treespec {
namespace {

constexpr int kSlots = 4;  // per linear: weight (or q), d, m, bias

// Columns [n0, n1) of thread t among T over N columns, in runs of 16 (whole vectors for every kernel).
inline std::pair<int64_t, int64_t> share(int64_t N, int t, int T) {
  const int64_t units = (N + 15) / 16;
  return {std::min(N, units * t / T * 16), std::min(N, units * (t + 1) / T * 16)};
}

// next[j] = u[j] + silu(y[j]) for j in [0, n) (vec.h `silu`; a last partial vector: y / (1 + e^-y)).
void residual_silu(const float* u, const float* y, float* next, int64_t n) {
  int64_t j = 0;
  for (; j + VL <= n; j += VL) storev(next + j, loadv(u + j) + silu(loadv(y + j)));
  for (; j < n; ++j) next[j] = u[j] + y[j] / (1.0f + std::exp(-y[j]));
}

// The k largest logits of one row [V] (ties: the lower index first) and their softmax probabilities.
void top_k(const float* logits, int64_t V, int k, int64_t* index, float* prob) {
  vf mv = splat(kNegInf);
  int64_t j = 0;
  for (; j + VL <= V; j += VL) mv = vmax(mv, loadv(logits + j));
  float top = kNegInf;
  for (int l = 0; l < VL; ++l) top = std::max(top, mv[l]);
  for (; j < V; ++j) top = std::max(top, logits[j]);
  const vf log2e = splat(1.4426950408889634f), mx = splat(top);
  vf sv = splat(0.0f);
  for (j = 0; j + VL <= V; j += VL) sv += exp2v((loadv(logits + j) - mx) * log2e);
  double sum = lane_sum(sv);
  for (; j < V; ++j) sum += std::exp(logits[j] - top);
  // insertion into the k best so far: a logit enters only if it beats the k-th
  std::vector<float> best(k, kNegInf);
  std::vector<int64_t> at(k, -1);
  for (j = 0; j < V; ++j) {
    const float v = logits[j];
    if (!(v > best[k - 1]) && at[k - 1] >= 0) continue;
    int i = k - 1;
    while (i > 0 && (v > best[i - 1] || at[i - 1] < 0)) {
      best[i] = best[i - 1];
      at[i] = at[i - 1];
      --i;
    }
    best[i] = v;
    at[i] = j;
  }
  for (int i = 0; i < k; ++i) {
    index[i] = at[i];
    prob[i] = static_cast<float>(std::exp(static_cast<double>(best[i]) - top) / sum);
  }
}

const Int8Weights kNoInt8{};  // the int8 form a linear has when drafting in float (never read)

// One level of the tree, read from the plan tensor (NativeHeads::propose says its layout).
struct Level {
  int64_t expanded_count = 0, child_count = 0, k = 0;
  const int64_t *expanded = nullptr, *parents = nullptr, *children = nullptr, *row = nullptr, *rank = nullptr;
};

}  // namespace

struct NativeHeads : torch::CustomClassHolder {
  std::vector<at::Tensor> held;  // the tensors the descriptors point into
  int64_t hidden = 0, vocab = 0, draft_vocab = 0;
  const void* embed = nullptr;  // [vocab, hidden] float32 or bf16: the target's input embedding
  bool embed_bf16 = false;
  const int64_t* vocab_map = nullptr;  // [draft_vocab] token id of each draft index, or nullptr (identity)
  bool sequential = true;                          // Hydra-style heads (P_k, `propose`), else independent
  std::vector<LinearWeights> proj;                 // P_k [hidden, hidden] per sequential head
  std::vector<std::vector<LinearWeights>> blocks;  // per head, per residual block: W [hidden, hidden] + b
  LinearWeights out;                               // [draft_vocab, hidden]
  // int8 drafting (int8_linear.h): every linear's int8 form in one arena, the rows quantized per linear
  bool int8 = false;
  std::vector<Int8Weights> iproj;
  std::vector<std::vector<Int8Weights>> iblocks;
  Int8Weights iout;
  AlignedBytes arena;
  int64_t arena_used = 0;
  QuantRows rows;
  // per call, reused: the embeddings, the two u buffers, a linear's output, logits, each row's top-k
  std::vector<float> emb, u0, u1, y, logits, states, top_prob;
  std::vector<int64_t> top_index;

  // dims: heads, blocks per head, hidden, vocab (the embedding's rows), draft vocabulary (the output's rows)[,
  // sequential (default 1)]; tensors: embedding (independent heads: may be empty), the draft vocabulary's
  // token ids (int64 [V'], or empty: the identity), then per head P's 4 slots (sequential heads only) and each
  // block's 4, then the output's 4; kinds: WeightKind per linear in that order.
  // int8: every linear must come as Q4_1 / Q8_0 blocks; they are repacked into the int8 layout (held
  // instead of the blocks) and each linear's input rows are quantized per block of 32 (int8_linear.h).
  NativeHeads(std::vector<int64_t> dims, std::vector<at::Tensor> tensors, std::vector<int64_t> kinds, bool int8_in) {
    TORCH_CHECK(dims.size() == 5 || dims.size() == 6, "treespec native heads: 5 or 6 dims expected");
    const int64_t heads = dims[0], per_head = dims[1];
    sequential = dims.size() == 5 || dims[5] != 0;
    hidden = dims[2];
    vocab = dims[3];
    draft_vocab = dims[4];
    TORCH_CHECK(heads >= 1 && per_head >= 0 && hidden >= 1 && draft_vocab >= 1 && draft_vocab <= vocab,
                "treespec native heads: bad dims");
    const size_t linears = static_cast<size_t>(heads * (per_head + (sequential ? 1 : 0)) + 1);
    TORCH_CHECK(tensors.size() == 2 + linears * kSlots && kinds.size() == linears, "treespec native heads: ",
                2 + linears * kSlots, " tensors and ", linears, " kinds expected, got ", tensors.size(), " and ",
                kinds.size());
    held = tensors;
    const at::Tensor& e = tensors[0];
    if (sequential || (e.defined() && e.numel() > 0)) {  // (independent heads read no embedding)
      TORCH_CHECK(e.is_cpu() && e.is_contiguous() && e.dim() == 2 && e.size(0) == vocab && e.size(1) == hidden &&
                      (e.scalar_type() == at::kFloat || e.scalar_type() == at::kBFloat16),
                  "treespec native heads: the embedding must be a contiguous float32 or bfloat16 [", vocab, ", ", hidden,
                  "] CPU tensor");
      embed = e.data_ptr();
      embed_bf16 = e.scalar_type() == at::kBFloat16;
    }
    const at::Tensor& map = tensors[1];
    if (map.defined() && map.numel() > 0) {
      TORCH_CHECK(map.scalar_type() == at::kLong && map.is_contiguous() && map.numel() == draft_vocab,
                  "treespec native heads: the draft vocabulary must be int64 [", draft_vocab, "]");
      const int64_t* ids = map.data_ptr<int64_t>();
      for (int64_t i = 0; i < draft_vocab; ++i)
        TORCH_CHECK(ids[i] >= 0 && ids[i] < vocab, "treespec native heads: draft token ", ids[i], " outside the vocabulary");
      vocab_map = ids;
    } else {
      TORCH_CHECK(draft_vocab == vocab, "treespec native heads: no draft vocabulary, so the output needs ", vocab, " rows");
    }
    size_t at = 2, kind = 0;
    for (int64_t h = 0; h < heads; ++h) {
      if (sequential) {
        proj.push_back(linear_from_slots(tensors, at, kinds[kind++], hidden, hidden));
        at += kSlots;
      }
      blocks.emplace_back();
      for (int64_t b = 0; b < per_head; ++b, at += kSlots)
        blocks.back().push_back(linear_from_slots(tensors, at, kinds[kind++], hidden, hidden));
    }
    out = linear_from_slots(tensors, at, kinds[kind], draft_vocab, hidden);
    int8 = int8_in;
    if (int8) to_int8();
  }

  // The int8 forms of every linear, side by side in one arena; the blocks they came from are let go.
  void to_int8() {
    std::vector<LinearWeights*> all;
    for (size_t h = 0; h < blocks.size(); ++h) {
      if (sequential) all.push_back(&proj[h]);
      for (LinearWeights& w : blocks[h]) all.push_back(&w);
    }
    all.push_back(&out);
    int64_t total = 0;
    for (const LinearWeights* w : all) {
      TORCH_CHECK(w->kind == WeightKind::kQ4_1 || w->kind == WeightKind::kQ8_0,
                  "treespec native heads: int8 drafting needs every linear as Q4_1 or Q8_0 blocks");
      total += int8_bytes(w->kind == WeightKind::kQ4_1, w->N, w->K);
    }
    arena = AlignedBytes(total);
    auto form = [&](const LinearWeights& w) {
      Int8Weights f = repack_int8(w, arena.data() + arena_used);
      arena_used += f.bytes();
      return f;
    };
    for (size_t h = 0; h < blocks.size(); ++h) {
      if (sequential) iproj.push_back(form(proj[h]));
      iblocks.emplace_back();
      for (const LinearWeights& w : blocks[h]) iblocks.back().push_back(form(w));
    }
    iout = form(out);
    for (LinearWeights* w : all) w->w = w->d = w->m = nullptr;  // read through the int8 forms only
    for (size_t i = 2; i < held.size(); ++i)  // the blocks (the biases stay: the int8 forms point to them)
      if (held[i].defined() && held[i].dim() == 2) held[i] = at::Tensor();
  }

  // Bytes of the int8 forms (0 when drafting in float).
  int64_t own_bytes() { return arena_used; }

  // hidden [B, H] float32 (the target's last hidden state per row), roots [B] int64, plan int64:
  //   [nodes, levels, then per level: n_d, c_d, k, expanded [n_d], parents [n_d], children [c_d],
  //    row [c_d], rank [c_d]]   (core.tree `Tree.levels`, flattened)
  // depth: draft levels 0..depth-1 only (< 0: all); the other nodes keep the root's token and probability 0.
  // Returns (tokens [B, nodes] int64, probs [B, nodes] float32), what SequentialDrafter.propose returns.
  std::tuple<at::Tensor, at::Tensor> propose(const at::Tensor& hidden_in, const at::Tensor& roots_in,
                                             const at::Tensor& plan_in, int64_t depth) {
    TORCH_CHECK(sequential, "treespec native heads: independent heads draft through head_topk()");
    TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.size(1) == hidden && hidden_in.is_cpu(),
                "treespec native heads: hidden must be [B, ", hidden, "] on the CPU");
    const at::Tensor x = hidden_in.to(at::kFloat).contiguous();
    const at::Tensor roots = roots_in.to(at::kLong).contiguous();
    const at::Tensor plan = plan_in.contiguous();
    const int64_t B = x.size(0);
    TORCH_CHECK(roots.numel() == B, "treespec native heads: ", roots.numel(), " roots for ", B, " rows");
    TORCH_CHECK(plan.scalar_type() == at::kLong && plan.dim() == 1 && plan.numel() >= 2,
                "treespec native heads: the plan must be an int64 vector");
    const int64_t* p = plan.data_ptr<int64_t>();
    const int64_t* end = p + plan.numel();
    const int64_t nodes = p[0], count = p[1];
    TORCH_CHECK(nodes >= 1 && count >= 0 && count <= static_cast<int64_t>(proj.size()),
                "treespec native heads: a plan of ", count, " levels for ", proj.size(), " heads");
    std::vector<Level> levels;
    const int64_t* q = p + 2;
    for (int64_t d = 0; d < count; ++d) {
      TORCH_CHECK(q + 3 <= end, "treespec native heads: the plan ends early");
      Level L;
      L.expanded_count = q[0];
      L.child_count = q[1];
      L.k = q[2];
      q += 3;
      TORCH_CHECK(L.expanded_count >= 1 && L.child_count >= 1 && L.k >= 1 && L.k <= draft_vocab &&
                      q + 2 * L.expanded_count + 3 * L.child_count <= end,
                  "treespec native heads: a bad plan level");
      L.expanded = q;
      L.parents = q + L.expanded_count;
      L.children = q + 2 * L.expanded_count;
      L.row = L.children + L.child_count;
      L.rank = L.row + L.child_count;
      q = L.rank + L.child_count;
      for (int64_t i = 0; i < L.expanded_count; ++i)
        TORCH_CHECK(L.expanded[i] >= 0 && L.expanded[i] < nodes && L.parents[i] >= 0 && L.parents[i] < nodes,
                    "treespec native heads: a plan node outside the tree");
      for (int64_t i = 0; i < L.child_count; ++i)
        TORCH_CHECK(L.children[i] > 0 && L.children[i] < nodes && L.row[i] >= 0 && L.row[i] < L.expanded_count &&
                        L.rank[i] >= 0 && L.rank[i] < L.k,
                    "treespec native heads: a plan child outside the tree");
      levels.push_back(L);
    }
    const int64_t* root = roots.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(root[b] >= 0 && root[b] < vocab, "treespec native heads: root token ", root[b], " outside the vocabulary");
    if (depth >= 0 && depth < count) levels.resize(depth);

    at::Tensor tokens = roots.reshape({B, 1}).repeat({1, nodes}).contiguous();  // [B, N] undrafted: the root
    at::Tensor probs = at::zeros({B, nodes}, x.options());                      // [B, N] undrafted: 0
    probs.select(1, 0).fill_(1.0f);
    int64_t* tok = tokens.data_ptr<int64_t>();
    float* pr = probs.data_ptr<float>();
    const int64_t H = hidden, V = draft_vocab;
    states.resize(B * nodes * H);  // [B, N, H] u at the expanded nodes
    const int threads = std::max(1, at::get_num_threads());
    for (const Level& L : levels) {
      const int64_t M = B * L.expanded_count;  // rows of this level: (b, i) -> b * n_d + i
      emb.resize(M * H);
      size_buffers(M, L.k);
      const int64_t level = &L - levels.data();
      for (int64_t r = 0; r < M; ++r) {  // u = the parents' states (the hidden at level 0); the embeddings
        const int64_t b = r / L.expanded_count, i = r % L.expanded_count;
        const float* src = level == 0 ? x.data_ptr<float>() + b * H : states.data() + (b * nodes + L.parents[i]) * H;
        std::copy(src, src + H, u0.data() + r * H);
        const int64_t id = tok[b * nodes + L.expanded[i]];
        if (embed_bf16)
          bf16_row_to_float(static_cast<const uint16_t*>(embed) + id * H, emb.data() + r * H, static_cast<int>(H));
        else
          std::copy(static_cast<const float*>(embed) + id * H, static_cast<const float*>(embed) + (id + 1) * H,
                    emb.data() + r * H);
      }
      const size_t head = static_cast<size_t>(level);
      columns(proj[head], int8 ? iproj[head] : kNoInt8, emb.data(), M, y.data(), H, threads);
      for (int64_t j = 0; j < M * H; ++j) u0[j] += y[j];  // u = before + P e
      const float* u = residual_blocks(head, u0.data(), u1.data(), M, threads);
      columns(out, iout, u, M, logits.data(), V, threads);
      row_top_k(M, L.k);
      for (int64_t r = 0; r < M; ++r) {
        const int64_t b = r / L.expanded_count, i = r % L.expanded_count;
        std::copy(u + r * H, u + (r + 1) * H, states.data() + (b * nodes + L.expanded[i]) * H);
      }
      for (int64_t b = 0; b < B; ++b)
        for (int64_t c = 0; c < L.child_count; ++c) {
          const int64_t r = b * L.expanded_count + L.row[c], slot = r * L.k + L.rank[c];
          const int64_t index = top_index[slot];
          tok[b * nodes + L.children[c]] = vocab_map != nullptr ? vocab_map[index] : index;
          pr[b * nodes + L.children[c]] = top_prob[slot];
        }
    }
    return {tokens, probs};
  }

  // Independent heads: hidden [B, H] float32 -> (tokens [B, count, k] int64, probs [B, count, k] float32), the k
  // most probable draft tokens of heads 0..count-1 (u = blocks_h(hidden); softmax(out u)), what MedusaDrafter's
  // torch path takes from `logits.softmax(-1).topk(k)`. The output rows are read once for all count x B rows.
  std::tuple<at::Tensor, at::Tensor> head_topk(const at::Tensor& hidden_in, int64_t count, int64_t k) {
    TORCH_CHECK(!sequential, "treespec native heads: sequential heads draft through propose()");
    TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.size(1) == hidden && hidden_in.is_cpu(),
                "treespec native heads: hidden must be [B, ", hidden, "] on the CPU");
    TORCH_CHECK(count >= 0 && count <= static_cast<int64_t>(blocks.size()) && k >= 1 && k <= draft_vocab,
                "treespec native heads: ", count, " heads of ", blocks.size(), ", top ", k, " of ", draft_vocab);
    const at::Tensor x = hidden_in.to(at::kFloat).contiguous();
    const int64_t B = x.size(0), H = hidden, V = draft_vocab, M = count * B;  // row h * B + b: head h, row b
    at::Tensor tokens = at::empty({B, count, k}, x.options().dtype(at::kLong));
    at::Tensor probs = at::empty({B, count, k}, x.options());
    if (M == 0) return {tokens, probs};
    size_buffers(M, k);
    const int threads = std::max(1, at::get_num_threads());
    for (int64_t h = 0; h < count; ++h) {  // each head's residual blocks over its B rows, into u0's rows h
      float* rows_h = u0.data() + h * B * H;
      std::copy(x.data_ptr<float>(), x.data_ptr<float>() + B * H, rows_h);
      const float* u = residual_blocks(static_cast<size_t>(h), rows_h, u1.data() + h * B * H, B, threads);
      if (u != rows_h) std::copy(u, u + B * H, rows_h);
    }
    columns(out, iout, u0.data(), M, logits.data(), V, threads);
    row_top_k(M, k);
    int64_t* tok = tokens.data_ptr<int64_t>();
    float* pr = probs.data_ptr<float>();
    for (int64_t h = 0; h < count; ++h)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < k; ++j) {
          const int64_t from = (h * B + b) * k + j, to = (b * count + h) * k + j;
          tok[to] = vocab_map != nullptr ? vocab_map[top_index[from]] : top_index[from];
          pr[to] = top_prob[from];
        }
    return {tokens, probs};
  }

  // The per-call buffers for M rows and a top-k of k: the two u buffers, a linear's output, logits, top-k.
  void size_buffers(int64_t M, int64_t k) {
    u0.resize(M * hidden);
    u1.resize(M * hidden);
    y.resize(M * hidden);
    logits.resize(M * draft_vocab);
    top_index.resize(M * k);
    top_prob.resize(M * k);
  }

  // Head h's residual blocks over the M rows [M, hidden] of u (u = u + silu(W u + b) each), ping-ponging
  // between u and spare; returns the buffer that holds the result.
  const float* residual_blocks(size_t h, float* u, float* spare, int64_t M, int threads) {
    for (size_t b = 0; b < blocks[h].size(); ++b) {
      columns(blocks[h][b], int8 ? iblocks[h][b] : kNoInt8, u, M, y.data(), hidden, threads);
      for (int64_t r = 0; r < M; ++r) residual_silu(u + r * hidden, y.data() + r * hidden, spare + r * hidden, hidden);
      std::swap(u, spare);
    }
    return u;
  }

  // Each of the M rows of logits: its k best draft indices and probabilities into top_index / top_prob.
  void row_top_k(int64_t M, int64_t k) {
    at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        top_k(logits.data() + r * draft_vocab, draft_vocab, static_cast<int>(k), top_index.data() + r * k,
              top_prob.data() + r * k);
    });
  }

  // out [M, N] = the linear (w, or its int8 form iw) over the M rows of `in`, its columns shared among the
  // threads (int8: the rows quantized first).
  void columns(const LinearWeights& w, const Int8Weights& iw, const float* in, int64_t M, float* dst, int64_t N,
               int threads) {
    if (int8) {
      rows.resize(M, w.K);
      for (int64_t r = 0; r < M; ++r) quantize_row(in + r * w.K, rows, r);
    }
#pragma omp parallel num_threads(threads)
    {
      const auto [n0, n1] = share(N, omp_get_thread_num(), omp_get_num_threads());
      if (int8)
        int8_columns(iw, rows, M, dst, N, n0, n1);
      else
        linear_columns(w, in, M, dst, N, n0, n1);
    }
  }
};

}  // namespace treespec

TORCH_LIBRARY_FRAGMENT(treespec, m) {
  m.class_<treespec::NativeHeads>("NativeHeads")
      .def(torch::init<std::vector<int64_t>, std::vector<at::Tensor>, std::vector<int64_t>, bool>())
      .def("own_bytes", &treespec::NativeHeads::own_bytes)
      .def("propose", &treespec::NativeHeads::propose)
      .def("head_topk", &treespec::NativeHeads::head_topk);
}
