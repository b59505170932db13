// The native decoding step for Llama-family decoders (Llama, Qwen2, Mistral): every layer of one
// verification forward in one call, over the model's own weights and the TreeKVCache's own tensors.
//
//   ids [A, n] -> embedding -> per layer:
//       x = RMSNorm(h); q, k, v = x Wq (+bq), x Wk (+bk), x Wv (+bv); rotary on q, k (cos/sin table rows
//       at each token's position); k, v written to cache row rows[a] at starts[a] + i;
//       tree attention over that row's keys [0, starts[a] + n) (the committed prefix + the tree block
//       under `bits`); h += o(attn); x = RMSNorm(h); h += down(silu(gate(x)) * up(x))
//   -> final RMSNorm -> hidden [A, n, H] (logits stay with the caller: the lm_head is one more linear)
//
// The same step runs the EAGLE-style draft layer (drafters/eagle_model.py; `NativeModelDesc::eagle`): one
// layer whose residual input is given (the target's fused features or the layer's own earlier output)
// instead of embedded, and whose q, k, v read u = [RMSNorm(embedding(id)), RMSNorm'(input)] [2H]:
//   h = input; u = ...; attention as above; h += o(attn); h += mlp(RMSNorm(h)) -> h out, and the final
//   RMSNorm for the draft lm_head. Its tokens may sit past the start of their block (`block_offset`: a
//   tree drafted level by level writes each level after the levels before it).
//
// Numerics follow the HF forward in the model's dtype: float32 throughout for float32 models; for bf16
// models every value the HF forward holds as a bf16 tensor is rounded to bf16 at the same place
// (norm outputs, projections, rotary products, residuals, the MLP's activations), the sums inside an
// operation stay float32. Every kernel is row-invariant (block_linear.h, exact.h): a token's result
// never depends on the other tokens of the call, except through attention to its ancestors.
// `exact` picks the row-invariant attention kernel (exact.h; "bitwise" numerics), else the fast one.
//
// Threads: one OpenMP parallel region for the whole step; each stage is a loop whose iterations any
// thread takes (dynamic schedule), so a thread delayed by another process leaves its share to the others.
#pragma once

#include <cstdint>
#include <vector>

#include "block_linear.h"
#include "int8_linear.h"

namespace treespec {

struct NativeLayer {
  const float* input_norm = nullptr;  // [hidden] float32
  const float* post_norm = nullptr;   // [hidden] float32
  // Qwen3: RMSNorm over each q / k head vector before the rotary embedding ([head_dim] float32); else null
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  LinearWeights q, k, v, o, gate, up, down;
  Int8Weights iq, ik, iv, io, igate, iup, idown;  // the same linears in the int8 form (int8 numerics only)
  void* keys = nullptr;    // cache [rows, kv_heads, max_len, head_dim] in the model's dtype (or bf16: kv_bf16)
  void* values = nullptr;
};

struct NativeModelDesc {
  int layers = 0, hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0, vocab = 0;
  float eps = 1e-5f, scale = 1.0f;     // RMSNorm epsilon, attention softmax scale
  bool bf16 = false;                    // the model's dtype is bfloat16 (else float32)
  bool int8 = false;                    // int8 numerics: every linear runs int8_linear.h's kernel
  bool eagle = false;                   // one EAGLE draft layer (the header comment): q, k, v are [., 2H]
  const float* hidden_norm = nullptr;   // eagle: [hidden] the norm of the residual input's half of u
  bool embed_bf16 = false;              // eagle: the (target's) embedding is bf16, the layer float32
  const void* embed = nullptr;          // [vocab, hidden] float32 or bf16
  const float* final_norm = nullptr;    // [hidden]
  std::vector<NativeLayer> layer;
  // the cache tensors' element strides (every layer's keys and values share them), rows and capacity
  int64_t cache_stride_b = 0, cache_stride_h = 0, cache_stride_l = 0;
  int cache_rows = 0, max_len = 0;
  // a float32 model's cache holds K / V in bf16 (each rounded to nearest even where it is written; attention
  // widens them exactly where it reads them, through the row-invariant kernel)
  bool kv_bf16 = false;
};

// How many threads the next step runs on. A step on T threads whose threads spent more than half their
// time waiting for each other (another process holds one of the cores, so a task stalls for a scheduler
// time slice) makes the next kBackoffSteps steps run on one thread fewer; then the full count is tried
// again. The step then slows in proportion to the cores it lost instead of several times over.
class ThreadGovernor {
 public:
  static constexpr int kBackoffSteps = 64;
  static constexpr double kWaitLimit = 0.5;
  explicit ThreadGovernor(int max_threads) : max_(max_threads < 1 ? 1 : max_threads), now_(max_) {}
  int threads() const { return now_; }
  void set_max(int max_threads) {
    max_ = max_threads < 1 ? 1 : max_threads;
    now_ = max_;
    backoff_ = 0;
  }
  // a step ran on `threads` threads that waited this fraction of their time
  void record(int threads, double waited) {
    if (threads > 1 && waited > kWaitLimit) {
      now_ = threads - 1;
      backoff_ = kBackoffSteps;
    } else if (now_ < max_ && --backoff_ <= 0) {
      now_ = max_;
    }
  }

 private:
  int max_, now_, backoff_ = 0;
};

struct NativeStepArgs {
  int A = 0, n = 0;                      // rows of the call, tokens per row
  const int64_t* ids = nullptr;          // [A, n]
  const int64_t* positions = nullptr;    // [A, n] rotary positions (rows of cos / sin)
  const int64_t* rows = nullptr;         // [A] cache row of each row
  const int64_t* starts = nullptr;       // [A] committed length of each row (its block starts there)
  const uint64_t* bits = nullptr;        // [n, words] ancestor bits of the block, nullptr = causal
  int words = 0;
  const float* cos = nullptr;            // [table, head_dim] rotary tables (already in the model's dtype)
  const float* sin = nullptr;
  int64_t table = 0;                     // rows of the tables
  // HF hidden_states indices to copy out: i < layers is the input of layer i (0: the embeddings), layers
  // the final normed output
  const int* feature_layers = nullptr;
  int num_features = 0;
  bool exact = false;                    // the row-invariant attention kernel
  // the tokens are positions block_offset .. block_offset + n - 1 of a block that starts at starts[a]: their
  // K/V land there, and they see the committed prefix [0, starts[a]) plus the block's keys before them that
  // `bits` rows block_offset.. allow (0: the block is this call's tokens)
  int block_offset = 0;
  const float* inputs = nullptr;         // eagle: [A, n, hidden] float32 residual inputs
  void* hidden = nullptr;                // out [A, n, hidden] in the model's dtype
  void* outputs = nullptr;               // out [A, n, hidden]: the last layer's output before the final norm,
                                         // or nullptr
  void* features = nullptr;              // out [A, n, num_features * hidden] in the model's dtype
  int64_t* profile_ns = nullptr;         // kNativeStageKinds counters of task time by stage kind, or nullptr
  ThreadGovernor* governor = nullptr;    // the thread count of the step (nullptr: every thread)
};

constexpr int kNativeStageKinds = 12;   // embed, norm1, qkv, rotary, attention, o, norm2, gate_up, down,
                                        // features, final, logits

// float32 work buffers of a step, grown on demand and kept between calls (no allocation in steady state)
struct NativeScratch {
  std::vector<float> h, x, qkv, attn, o, gate, up, act;
  std::vector<float> u;                    // eagle: [M, 2H] the q / k / v input
  std::vector<uint16_t> q_bf16, out_bf16;  // attention q / output in bf16 models
  std::vector<float> q_f32, out_f32;       // ... in float32 models
  QuantRows xq, attnq, actq;               // int8 numerics: the normed rows, attention outputs, MLP activations
};

void native_step_cpu(const NativeModelDesc& m, const NativeStepArgs& a, NativeScratch& s);
// out[M, N] = x[M, K] @ w^T (+ bias) on the step's scheduler (the lm_head of the rows the caller reads).
// best: nullptr, or [M]: each row's argmax (argmax.h), each task taking the maximum of the columns it wrote
void native_linear_cpu(const LinearWeights& w, const float* x, int64_t M, float* out, int64_t columns_per_task,
                       ThreadGovernor* governor = nullptr, int64_t* profile_ns = nullptr, int64_t* best = nullptr);
// The same in int8 numerics: the rows quantized into `rows`, then int8_linear.h's kernel (columns_per_task a
// multiple of 16)
void native_int8_linear_cpu(const Int8Weights& w, const float* x, int64_t M, QuantRows& rows, float* out,
                            int64_t columns_per_task, ThreadGovernor* governor = nullptr, int64_t* profile_ns = nullptr,
                            int64_t* best = nullptr);

}  // namespace treespec
