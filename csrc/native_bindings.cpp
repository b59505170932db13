// The torch binding of the native step (native_step.h): a custom class `treespec.NativeModel` that holds
// the model's weight tensors (the HF module's own, and the exact blocks of core.blocks) and the bound
// cache's tensors, and runs one step per call. Python side: treespec/core/native.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "argmax.h"
#include "linear_slots.h"
#include "native_step.h"

namespace treespec {
namespace {

constexpr int kLinearsPerLayer = 7;  // q, k, v, o, gate, up, down
constexpr int kSlotsPerLinear = 4;   // weight (or q), d, m, bias

bool present(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

const float* float_pointer(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.is_cpu(), "treespec native step: ", what,
              " must be a contiguous float32 CPU tensor, got ", t.scalar_type(), " ", t.sizes());
  return t.data_ptr<float>();
}

}  // namespace

LinearWeights linear_from_slots(const std::vector<at::Tensor>& tensors, size_t at, int64_t kind, int64_t N, int64_t K) {
  LinearWeights w;
  w.kind = static_cast<WeightKind>(kind);
  w.N = N;
  w.K = K;
  const at::Tensor &t = tensors[at], &d = tensors[at + 1], &mm = tensors[at + 2], &bias = tensors[at + 3];
  TORCH_CHECK(t.is_contiguous() && t.is_cpu() && t.dim() == 2 && t.size(0) == N, "treespec native step: a linear has ",
              "weights ", t.sizes(), ", expected ", N, " rows");
  switch (w.kind) {
    case WeightKind::kFloat32:
    case WeightKind::kBFloat16:
      TORCH_CHECK(t.size(1) == K && t.scalar_type() == (w.kind == WeightKind::kFloat32 ? at::kFloat : at::kBFloat16),
                  "treespec native step: dense weight ", t.sizes(), " ", t.scalar_type(), " does not fit [", N, ", ", K,
                  "]");
      break;
    case WeightKind::kQ4_1:
    case WeightKind::kQ8_0: {
      const bool q4 = w.kind == WeightKind::kQ4_1;
      TORCH_CHECK(K % 32 == 0 && t.size(1) == (q4 ? K / 2 : K) && t.scalar_type() == (q4 ? at::kByte : at::kChar) &&
                      d.numel() == N * (K / 32) && (!q4 || mm.numel() == d.numel()),
                  "treespec native step: blocks do not fit [", N, ", ", K, "]");
      // float16 scales (the values a GGUF file stores, half the bytes of float32 ones) or float32
      w.half_scales = d.scalar_type() == at::kHalf;
      const auto scale_type = w.half_scales ? at::kHalf : at::kFloat;
      TORCH_CHECK(d.scalar_type() == scale_type && d.is_contiguous() && (!q4 || (mm.scalar_type() == scale_type &&
                                                                                    mm.is_contiguous())),
                  "treespec native step: block scales must be contiguous float16 or float32 tensors");
      w.d = d.data_ptr();
      w.m = q4 ? mm.data_ptr() : nullptr;
      break;
    }
    default: TORCH_CHECK(false, "treespec native step: unknown weight kind ", kind);
  }
  w.w = t.data_ptr();
  if (present(bias)) {
    TORCH_CHECK(bias.numel() == N, "treespec native step: a bias of ", bias.numel(), " for ", N, " outputs");
    w.bias = float_pointer(bias, "a bias");
  }
  return w;
}

struct NativeModel : torch::CustomClassHolder {
  NativeModelDesc desc;
  NativeScratch scratch;
  std::vector<at::Tensor> held;        // the weights the descriptors point into
  std::vector<at::Tensor> cache_held;  // the bound cache's tensors
  bool cache_bound = false;
  LinearWeights lm_head;
  Int8Weights lm_head_int8;  // int8 numerics
  QuantRows logits_rows;     // int8 numerics: the rows of a logits() call
  ThreadGovernor governor{at::get_num_threads()};
  bool profiling = false;
  std::vector<int64_t> profile_ns = std::vector<int64_t>(kNativeStageKinds, 0);

  // Task time by stage kind from now on (on) or not (off); profile() reads and clears the counters.
  void set_profiling(bool on) {
    profiling = on;
    std::fill(profile_ns.begin(), profile_ns.end(), 0);
  }

  // Seconds of task time per stage kind since the last read (summed over threads), then cleared.
  std::vector<double> profile() {
    std::vector<double> out;
    for (int64_t& ns : profile_ns) {
      out.push_back(static_cast<double>(ns) * 1e-9);
      ns = 0;
    }
    return out;
  }

  // dims: layers, hidden, heads, kv_heads, head_dim, intermediate, vocab[, eagle[, qk_norm]]; numbers: eps,
  // scale; tensors: embed, final norm, then per layer: input norm, post norm[, qk_norm: q norm, k norm
  // (Qwen3: [head_dim] each, applied to every q / k head before the rotary)], 7 linears x (w, d, m, bias) with
  // empty tensors where a slot is unused, then the lm_head's 4 slots[, eagle: the hidden norm]; kinds: 7
  // WeightKind values per layer, then the lm_head's. int8: int8 numerics (int8_linear.h): every linear must
  // come as Q4_1 / Q8_0 blocks; they are repacked into the int8 layout, which the model then holds instead
  // of the blocks. eagle (dims[7] = 1): one EAGLE draft layer (native_step.h), its q, k, v [., 2 hidden], its
  // lm_head over the draft vocabulary (vocab: the embedding's rows; the lm_head's rows: dims[6] too, so the
  // caller passes the draft vocabulary's size there and the embedding's rows are read from the tensor).
  NativeModel(std::vector<int64_t> dims, std::vector<double> numbers, std::vector<at::Tensor> tensors,
              std::vector<int64_t> kinds, bool int8) {
    TORCH_CHECK(dims.size() >= 7 && dims.size() <= 9 && numbers.size() == 2,
                "treespec native step: 7 to 9 dims and 2 numbers expected");
    NativeModelDesc& m = desc;
    m.eagle = dims.size() >= 8 && dims[7] != 0;
    const bool qk_norm = dims.size() == 9 && dims[8] != 0;  // Qwen3: per layer a q norm and a k norm
    TORCH_CHECK(!qk_norm || !m.eagle, "treespec native step: an EAGLE layer has no q / k norms");
    TORCH_CHECK(!m.eagle || (dims[0] == 1 && !int8), "treespec native step: an EAGLE layer is one layer, float numerics");
    m.layers = static_cast<int>(dims[0]);
    m.hidden = static_cast<int>(dims[1]);
    m.heads = static_cast<int>(dims[2]);
    m.kv_heads = static_cast<int>(dims[3]);
    m.head_dim = static_cast<int>(dims[4]);
    m.intermediate = static_cast<int>(dims[5]);
    m.vocab = static_cast<int>(dims[6]);
    m.eps = static_cast<float>(numbers[0]);
    m.scale = static_cast<float>(numbers[1]);
    m.int8 = int8;
    TORCH_CHECK(!int8 || (m.hidden % 32 == 0 && m.intermediate % 32 == 0 && m.head_dim % 32 == 0),
                "treespec native step: int8 numerics need hidden size, intermediate size and head_dim in multiples of "
                "32, got ", m.hidden, ", ", m.intermediate, ", ", m.head_dim);
    TORCH_CHECK(m.kv_heads > 0 && m.heads % m.kv_heads == 0 && m.head_dim % 2 == 0 && m.head_dim <= 512,
                "treespec native step: heads ", m.heads, " / kv heads ", m.kv_heads, " / head_dim ", m.head_dim,
                " not supported");
    const size_t expected =
        2 + static_cast<size_t>(m.layers) * ((qk_norm ? 4 : 2) + kLinearsPerLayer * kSlotsPerLinear) + kSlotsPerLinear +
        (m.eagle ? 1 : 0);
    const size_t expected_kinds = static_cast<size_t>(m.layers) * kLinearsPerLayer + 1;
    TORCH_CHECK(tensors.size() == expected && kinds.size() == expected_kinds, "treespec native step: ", expected,
                " tensors and ", expected_kinds, " kinds expected, got ", tensors.size(), " and ", kinds.size());
    held = tensors;
    const at::Tensor& embed = tensors[0];
    const int64_t lm_rows = m.vocab;  // the lm_head's rows (eagle: the draft vocabulary)
    if (m.eagle) m.vocab = static_cast<int>(embed.size(0));
    TORCH_CHECK(embed.is_contiguous() && embed.dim() == 2 && embed.size(0) == m.vocab && embed.size(1) == m.hidden &&
                    (embed.scalar_type() == at::kFloat || embed.scalar_type() == at::kBFloat16),
                "treespec native step: the embedding must be a contiguous float32 or bfloat16 [vocab, hidden] tensor");
    // the model's dtype is the embedding's; an EAGLE layer is float32 over a float32 or bf16 embedding
    m.bf16 = !m.eagle && embed.scalar_type() == at::kBFloat16;
    m.embed_bf16 = m.eagle && embed.scalar_type() == at::kBFloat16;
    m.embed = embed.data_ptr();
    m.final_norm = float_pointer(tensors[1], "the final norm");
    size_t at = 2;
    const int64_t q_width = static_cast<int64_t>(m.heads) * m.head_dim, kv_width = static_cast<int64_t>(m.kv_heads) * m.head_dim;
    const int64_t qkv_in = m.eagle ? 2 * m.hidden : m.hidden;
    const int64_t shapes[kLinearsPerLayer][2] = {{q_width, qkv_in}, {kv_width, qkv_in}, {kv_width, qkv_in},
                                                 {m.hidden, q_width},  {m.intermediate, m.hidden},
                                                 {m.intermediate, m.hidden}, {m.hidden, m.intermediate}};
    if (int8) {  // one arena for every int8 form (2 MB pages): per layer the 7 linears, then the lm_head
      int64_t total = 0;
      for (int l = 0; l < m.layers; ++l)
        for (int j = 0; j < kLinearsPerLayer; ++j)
          total += int8_bytes(kinds[l * kLinearsPerLayer + j] == static_cast<int64_t>(WeightKind::kQ4_1), shapes[j][0], shapes[j][1]);
      total += int8_bytes(kinds.back() == static_cast<int64_t>(WeightKind::kQ4_1), m.vocab, m.hidden);
      int8_arena = AlignedBytes(total);
    }
    for (int l = 0; l < m.layers; ++l) {
      NativeLayer L;
      L.input_norm = float_pointer(tensors[at++], "a layer norm");
      L.post_norm = float_pointer(tensors[at++], "a layer norm");
      if (qk_norm) {
        for (const at::Tensor& t : {tensors[at], tensors[at + 1]})
          TORCH_CHECK(t.numel() == m.head_dim, "treespec native step: a q / k norm must have head_dim (", m.head_dim,
                      ") values, got ", t.numel());
        L.q_norm = float_pointer(tensors[at++], "a q norm");
        L.k_norm = float_pointer(tensors[at++], "a k norm");
      }
      LinearWeights* linears[kLinearsPerLayer] = {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down};
      for (int j = 0; j < kLinearsPerLayer; ++j) {
        *linears[j] = linear_from_slots(tensors, at, kinds[l * kLinearsPerLayer + j], shapes[j][0], shapes[j][1]);
        at += kSlotsPerLinear;
      }
      if (int8) {
        Int8Weights* forms[kLinearsPerLayer] = {&L.iq, &L.ik, &L.iv, &L.io, &L.igate, &L.iup, &L.idown};
        for (int j = 0; j < kLinearsPerLayer; ++j) *forms[j] = int8_form(*linears[j], at - (kLinearsPerLayer - j) * kSlotsPerLinear);
      }
      m.layer.push_back(std::move(L));
    }
    lm_head = linear_from_slots(tensors, at, kinds.back(), lm_rows, m.hidden);
    if (int8) lm_head_int8 = int8_form(lm_head, at);
    if (m.eagle) m.hidden_norm = float_pointer(tensors[at + kSlotsPerLinear], "the hidden norm");
  }

  // The int8 form of the linear whose slots start at `at`; the blocks it was made from are let go (the
  // descriptor keeps only its bias).
  Int8Weights int8_form(LinearWeights& w, size_t at) {
    TORCH_CHECK(w.kind == WeightKind::kQ4_1 || w.kind == WeightKind::kQ8_0,
                "treespec native step: int8 numerics need every linear as Q4_1 or Q8_0 blocks (core.native quantizes "
                "dense ones)");
    TORCH_CHECK(int8_used + int8_bytes(w.kind == WeightKind::kQ4_1, w.N, w.K) <= int8_arena.size(),
                "treespec native step: int8 arena too small");
    Int8Weights out = repack_int8(w, int8_arena.data() + int8_used);
    w.w = w.d = w.m = nullptr;
    for (int i = 0; i < 3; ++i) held[at + i] = at::Tensor();
    int8_used += out.bytes();
    return out;
  }
  AlignedBytes int8_arena;  // the int8 forms' bytes
  int64_t int8_used = 0;

  // Bytes of the int8 forms this model holds (0 outside int8 numerics).
  int64_t own_bytes() { return int8_used; }

  // The lm_head over hidden states [..., hidden] in the model's dtype -> logits [..., vocab] in that dtype
  // (bf16 models: rounded to bf16, as the HF lm_head's output is).
  at::Tensor logits(const at::Tensor& hidden) { return lm_head_call(hidden, nullptr); }

  // (logits, best): the logits and each row's argmax [...] (int64; what logits.max(dim=-1).indices gives),
  // taken by the lm_head's tasks from the columns they computed (argmax.h).
  std::tuple<at::Tensor, at::Tensor> logits_argmax(const at::Tensor& hidden) {
    std::vector<int64_t> shape(hidden.sizes().begin(), hidden.sizes().end() - 1);
    at::Tensor best = at::empty(shape, hidden.options().dtype(at::kLong));
    at::Tensor out = lm_head_call(hidden, desc.bf16 ? nullptr : best.data_ptr<int64_t>());
    if (desc.bf16) {  // the argmax of the rounded logits (rounding can tie values that differed)
      const at::Tensor rounded = out.to(at::kFloat).contiguous();
      rows_argmax(rounded.data_ptr<float>(), best.numel(), rounded.size(-1), best.data_ptr<int64_t>());
    }
    return {out, best};
  }

  at::Tensor lm_head_call(const at::Tensor& hidden, int64_t* best) {
    const NativeModelDesc& m = desc;
    TORCH_CHECK(hidden.size(-1) == m.hidden && hidden.is_cpu() &&
                    hidden.scalar_type() == (m.bf16 ? at::kBFloat16 : at::kFloat),
                "treespec native logits: hidden states [..., ", m.hidden, "] in the model's dtype expected");
    const at::Tensor x = hidden.to(at::kFloat).contiguous();
    std::vector<int64_t> shape(hidden.sizes().begin(), hidden.sizes().end());
    shape.back() = lm_head.N;
    at::Tensor out = at::empty(shape, x.options());
    sync_threads();
    int64_t* profile = profiling ? profile_ns.data() : nullptr;
    if (m.int8)
      native_int8_linear_cpu(lm_head_int8, x.data_ptr<float>(), x.numel() / m.hidden, logits_rows,
                             out.data_ptr<float>(), 256, &governor, profile, best);
    else
      native_linear_cpu(lm_head, x.data_ptr<float>(), x.numel() / m.hidden, out.data_ptr<float>(), 256, &governor,
                        profile, best);
    return m.bf16 ? out.to(at::kBFloat16) : out;
  }

  // The cache the steps write: every layer's keys and values [rows, kv_heads, max_len, head_dim], in the
  // model's dtype or (a float32 model) in bf16.
  void bind_cache(std::vector<at::Tensor> keys, std::vector<at::Tensor> values) {
    NativeModelDesc& m = desc;
    TORCH_CHECK(keys.size() == static_cast<size_t>(m.layers) && values.size() == keys.size(),
                "treespec native step: one keys and one values tensor per layer expected");
    const at::Tensor& first = keys[0];
    TORCH_CHECK(first.dim() == 4 && first.size(1) == m.kv_heads && first.size(3) == m.head_dim && first.stride(3) == 1 &&
                    (first.scalar_type() == at::kBFloat16 || (!m.bf16 && first.scalar_type() == at::kFloat)) &&
                    first.is_cpu(),
                "treespec native step: the cache must hold [rows, ", m.kv_heads, ", max_len, ", m.head_dim,
                "] CPU tensors in the model's dtype (or bfloat16), got ", first.sizes(), " ", first.scalar_type());
    m.kv_bf16 = !m.bf16 && first.scalar_type() == at::kBFloat16;
    cache_held.clear();
    for (size_t l = 0; l < keys.size(); ++l) {
      for (const at::Tensor* t : {&keys[l], &values[l]})
        TORCH_CHECK(t->sizes() == first.sizes() && t->strides() == first.strides() &&
                        t->scalar_type() == first.scalar_type(),
                    "treespec native step: every cache tensor must have the shape and strides of the first");
      m.layer[l].keys = keys[l].data_ptr();
      m.layer[l].values = values[l].data_ptr();
      cache_held.push_back(keys[l]);
      cache_held.push_back(values[l]);
    }
    m.cache_stride_b = first.stride(0);
    m.cache_stride_h = first.stride(1);
    m.cache_stride_l = first.stride(2);
    m.cache_rows = static_cast<int>(first.size(0));
    m.max_len = static_cast<int>(first.size(2));
    cache_bound = true;
  }

  // torch.set_num_threads since the last call: the governor's ceiling follows it
  void sync_threads() {
    const int max_threads = at::get_num_threads();
    if (max_threads != max_threads_seen) {
      governor.set_max(max_threads);
      max_threads_seen = max_threads;
    }
  }
  int max_threads_seen = at::get_num_threads();

  // The threads the next step runs on (the governor's choice)
  int64_t threads() { return governor.threads(); }

  // The address of the bound cache's first keys tensor (0 when none): a model shared by decoders rebinds
  // when another decoder's cache is bound.
  int64_t bound_to() { return cache_bound ? reinterpret_cast<int64_t>(desc.layer[0].keys) : 0; }

  // The arguments of one call, checked: ids, positions [A, n] int64; rows, starts [A] int64; bits [m, W]
  // int64 (m >= block_offset + n) or None (causal); cos, sin [P, head_dim] float32. `held` keeps the
  // contiguous bits alive.
  NativeStepArgs prepare(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& rows,
                         const at::Tensor& starts, const std::optional<at::Tensor>& bits, int64_t block_offset,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor& held_bits) {
    const NativeModelDesc& m = desc;
    TORCH_CHECK(cache_bound, "treespec native step: bind_cache() first");
    TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && ids.is_contiguous() && positions.sizes() == ids.sizes() &&
                    positions.scalar_type() == at::kLong && positions.is_contiguous(),
                "treespec native step: ids and positions must be contiguous int64 [A, n] tensors");
    const int64_t A = ids.size(0), n = ids.size(1);
    TORCH_CHECK(A >= 1 && n >= 1 && rows.numel() == A && starts.numel() == A && rows.scalar_type() == at::kLong &&
                    starts.scalar_type() == at::kLong && rows.is_contiguous() && starts.is_contiguous(),
                "treespec native step: rows and starts must be contiguous int64 [A] tensors");
    TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(1) == m.head_dim,
                "treespec native step: cos and sin must be [P, head_dim]");
    TORCH_CHECK(block_offset >= 0, "treespec native step: block offset ", block_offset, " < 0");
    const int64_t block_n = block_offset + n;
    const float* cp = float_pointer(cos, "cos");
    const float* sp = float_pointer(sin, "sin");
    const int64_t* id = ids.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* rp = rows.data_ptr<int64_t>();
    const int64_t* st = starts.data_ptr<int64_t>();
    for (int64_t i = 0; i < A * n; ++i) {
      TORCH_CHECK(id[i] >= 0 && id[i] < m.vocab, "treespec native step: token id ", id[i], " outside the vocabulary of ",
                  m.vocab);
      TORCH_CHECK(pos[i] >= 0 && pos[i] < cos.size(0), "treespec native step: position ", pos[i],
                  " outside the rotary table of ", cos.size(0));
    }
    for (int64_t a = 0; a < A; ++a) {
      TORCH_CHECK(rp[a] >= 0 && rp[a] < m.cache_rows, "treespec native step: row ", rp[a], " outside a cache of ",
                  m.cache_rows, " rows");
      TORCH_CHECK(st[a] >= 0 && st[a] + block_n <= m.max_len, "treespec native step: row ", rp[a], " writes up to ",
                  st[a] + block_n, " in a cache of ", m.max_len);
    }
    NativeStepArgs args;
    if (bits.has_value() && bits->defined()) {
      held_bits = bits->contiguous();
      TORCH_CHECK(held_bits.scalar_type() == at::kLong && held_bits.dim() == 2 && held_bits.size(0) >= block_n &&
                      held_bits.size(1) >= (block_n + 63) / 64,
                  "treespec native step: bits must be int64 [block_offset + n, ceil((block_offset + n) / 64)]");
      args.bits = reinterpret_cast<const uint64_t*>(held_bits.data_ptr<int64_t>());
      args.words = static_cast<int>(held_bits.size(1));
    }
    args.A = static_cast<int>(A);
    args.n = static_cast<int>(n);
    args.block_offset = static_cast<int>(block_offset);
    args.ids = id;
    args.positions = pos;
    args.rows = rp;
    args.starts = st;
    args.cos = cp;
    args.sin = sp;
    args.table = cos.size(0);
    args.profile_ns = profiling ? profile_ns.data() : nullptr;
    sync_threads();
    args.governor = &governor;
    return args;
  }

  // One step: ids, positions [A, n] int64; rows, starts [A] int64; bits [n, W] int64 or None (causal);
  // cos, sin [P, head_dim] float32; feature_layers: HF hidden_states indices. Returns (hidden [A, n, hidden],
  // features [A, n, len(feature_layers) * hidden], empty without feature layers), both in the model's dtype.
  std::tuple<at::Tensor, at::Tensor> step(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& rows,
                                          const at::Tensor& starts, const std::optional<at::Tensor>& bits,
                                          const at::Tensor& cos, const at::Tensor& sin,
                                          std::vector<int64_t> feature_layers, bool exact) {
    const NativeModelDesc& m = desc;
    TORCH_CHECK(!m.eagle, "treespec native step: an EAGLE layer runs eagle_step()");
    at::Tensor held_bits;
    NativeStepArgs args = prepare(ids, positions, rows, starts, bits, 0, cos, sin, held_bits);
    std::vector<int> features(feature_layers.begin(), feature_layers.end());
    for (int f : features)
      TORCH_CHECK(f >= 0 && f <= m.layers, "treespec native step: feature layer ", f, " outside [0, ", m.layers, "]");
    const int64_t A = ids.size(0), n = ids.size(1);
    const auto options = ids.options().dtype(m.bf16 ? at::kBFloat16 : at::kFloat);
    at::Tensor hidden = at::empty({A, n, m.hidden}, options);
    at::Tensor feats = at::empty({A, n, static_cast<int64_t>(features.size()) * m.hidden}, options);
    args.feature_layers = features.data();
    args.num_features = static_cast<int>(features.size());
    args.exact = exact;
    args.hidden = hidden.data_ptr();
    args.features = feats.data_ptr();
    native_step_cpu(m, args, scratch);
    return {hidden, feats};
  }

  // One call of an EAGLE draft layer: inputs [A, n, hidden] float32 (the residual inputs), ids, positions
  // [A, n]; rows, starts [A]: the tokens are positions block_offset.. of a block at starts[a] (bits [m, W] as
  // prepare() says, or None: causal). Returns (outputs [A, n, hidden]: the layer's outputs, logits over the
  // final norm: [A, n, draft vocab], or with logit_rows (int64 [A]) [A, draft vocab] of token logit_rows[a]
  // of row a only), float32.
  std::tuple<at::Tensor, at::Tensor> eagle_step(const at::Tensor& inputs, const at::Tensor& ids,
                                                const at::Tensor& positions, const at::Tensor& rows,
                                                const at::Tensor& starts, const std::optional<at::Tensor>& bits,
                                                int64_t block_offset, const at::Tensor& cos, const at::Tensor& sin,
                                                const std::optional<at::Tensor>& logit_rows) {
    const NativeModelDesc& m = desc;
    TORCH_CHECK(m.eagle, "treespec native step: eagle_step() runs an EAGLE layer");
    at::Tensor held_bits;
    NativeStepArgs args = prepare(ids, positions, rows, starts, bits, block_offset, cos, sin, held_bits);
    const int64_t A = ids.size(0), n = ids.size(1);
    TORCH_CHECK(inputs.dim() == 3 && inputs.size(0) == A && inputs.size(1) == n && inputs.size(2) == m.hidden,
                "treespec native step: EAGLE inputs must be [A, n, ", m.hidden, "]");
    const at::Tensor in = inputs.to(at::kFloat).contiguous();
    at::Tensor normed = at::empty({A, n, m.hidden}, in.options());
    at::Tensor outputs = at::empty({A, n, m.hidden}, in.options());
    args.inputs = in.data_ptr<float>();
    args.hidden = normed.data_ptr();
    args.outputs = outputs.data_ptr();
    native_step_cpu(m, args, scratch);
    if (!logit_rows.has_value() || !logit_rows->defined()) return {outputs, logits(normed)};
    const at::Tensor picked = logit_rows->to(at::kLong);
    TORCH_CHECK(picked.numel() == A && (picked.min().item<int64_t>() >= 0) && (picked.max().item<int64_t>() < n),
                "treespec native step: logit_rows must be [A] token indices below ", n);
    return {outputs, logits(normed.index({at::arange(A), picked.reshape({A})}))};
  }
};

// int8 numerics of one linear for tests (int8_linear.h): x [M, K] float32 against Q4_1 blocks (q uint8
// [N, K/2], d and m [N, K/32]) or Q8_0 blocks (q int8 [N, K], m None), + bias; engine: Int8Engine (0: the
// fastest here, 1: the scalar reference, 2: AVX2, 3: AVX-512 VNNI; one this build lacks is refused);
// columns [n0, n1) only (n1 = -1: N; n0 a multiple of 16, n1 one too or N), the others left NaN.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m,
                       const std::optional<at::Tensor>& bias, int64_t engine, int64_t n0, int64_t n1) {
  const std::vector<Int8Engine> engines = int8_engines();
  TORCH_CHECK(engine == 0 || std::find(engines.begin(), engines.end(), static_cast<Int8Engine>(engine)) != engines.end(),
              "int8_linear: engine ", engine, " is not in this build");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_cpu(), "int8_linear: x must be float32 [M, K]");
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  const bool q4 = m.has_value() && m->defined();
  std::vector<at::Tensor> slots = {q.contiguous(), d.contiguous(), q4 ? m->contiguous() : at::Tensor(),
                                   bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor()};
  const LinearWeights w = linear_from_slots(slots, 0, static_cast<int64_t>(q4 ? WeightKind::kQ4_1 : WeightKind::kQ8_0),
                                                 N, K);
  const Int8Weights iw = repack_int8(w);
  QuantRows rows;
  rows.resize(M, K);
  for (int64_t r = 0; r < M; ++r) quantize_row(xc.data_ptr<float>() + r * K, rows, r);
  if (n1 < 0) n1 = N;
  TORCH_CHECK(0 <= n0 && n0 % 16 == 0 && n0 <= n1 && n1 <= N && (n1 % 16 == 0 || n1 == N),
              "int8_linear: columns [", n0, ", ", n1, ") must start on a multiple of 16 and end on one or at N = ", N);
  at::Tensor out = at::full({M, N}, std::numeric_limits<float>::quiet_NaN(), xc.options());
  int8_columns(iw, rows, M, out.data_ptr<float>(), N, n0, n1, static_cast<Int8Engine>(engine));
  return out;
}

// int8 numerics of activations for tests: x [M, K] -> (q int8 [M, K], d float32 [M, K/32], sum int32 [M, K/32])
std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_quantize(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 32 == 0, "int8_quantize: x must be float32 [M, K], K % 32 == 0");
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  QuantRows rows;
  rows.resize(M, K);
  for (int64_t r = 0; r < M; ++r) quantize_row(xc.data_ptr<float>() + r * K, rows, r);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / 32}, x.options());
  at::Tensor s = at::empty({M, K / 32}, x.options().dtype(at::kInt));
  std::memcpy(q.data_ptr(), rows.q.data(), M * K);
  std::memcpy(d.data_ptr(), rows.d.data(), sizeof(float) * M * (K / 32));
  std::memcpy(s.data_ptr(), rows.sum.data(), sizeof(int32_t) * M * (K / 32));
  return {q, d, s};
}

// The Int8Engine values this build has, the fastest last.
std::vector<int64_t> int8_engine_list() {
  std::vector<int64_t> out;
  for (Int8Engine e : int8_engines()) out.push_back(static_cast<int64_t>(e));
  return out;
}

}  // namespace treespec

TORCH_LIBRARY_FRAGMENT(treespec, m) {
  m.class_<treespec::NativeModel>("NativeModel")
      .def(torch::init<std::vector<int64_t>, std::vector<double>, std::vector<at::Tensor>, std::vector<int64_t>, bool>())
      .def("own_bytes", &treespec::NativeModel::own_bytes)
      .def("bind_cache", &treespec::NativeModel::bind_cache)
      .def("bound_to", &treespec::NativeModel::bound_to)
      .def("threads", &treespec::NativeModel::threads)
      .def("step", &treespec::NativeModel::step)
      .def("eagle_step", &treespec::NativeModel::eagle_step)
      .def("logits", &treespec::NativeModel::logits)
      .def("logits_argmax", &treespec::NativeModel::logits_argmax)
      .def("set_profiling", &treespec::NativeModel::set_profiling)
      .def("profile", &treespec::NativeModel::profile);
  m.def("int8_linear(Tensor x, Tensor q, Tensor d, Tensor? m, Tensor? bias, int engine, int n0=0, int n1=-1) -> Tensor");
  m.def("int8_quantize(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("int8_engines() -> int[]", &treespec::int8_engine_list);
}

TORCH_LIBRARY_IMPL(treespec, CPU, m) {
  m.impl("int8_linear", &treespec::int8_linear);
  m.impl("int8_quantize", &treespec::int8_quantize);
}
