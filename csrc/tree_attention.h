// treespec tree attention: the plain C++ interface between the kernels and the torch bindings.
//
// Layering (FlashInfer-style):
//   kernel    tree_attention_cuda.cu (CUDA) / tree_attention_cpu.cpp (CPU)
//   launcher  the functions declared here: raw pointers, element strides, sizes; no torch types
//   binding   bindings.cpp (schema + CPU) and bindings_cuda.cpp (CUDA): tensors -> these structs
//   loader    treespec/ops.py: JIT build, torch.library registration of fake kernels, fallbacks
//
// This header includes no torch and no CUDA header, so the CUDA file compiles standalone with nvcc
// (`nvcc -c -arch=sm_90 -std=c++17 csrc/tree_attention_cuda.cu`) and the bindings compile with the
// host compiler.
//
// The contract (same on every device):
//   n new query tokens attend over keys [0, L), L = c + n. Keys [0, c) (the committed prefix) are
//   visible to every query; inside the tree block [c, L) query i sees key c + j iff bit j % 64 of
//   word j / 64 of bits[i] is set (j is i or an ancestor of i), or, with bits == nullptr, iff j <= i
//   (causal, a chain). q: [B, H, n, D]; k, v: [B, Hkv, L, D] read through their strides (a view of a
//   larger cache buffer); H = G * Hkv (grouped-query attention, K/V heads are never expanded).
//   out: [B, n, H, D] contiguous, written directly. Softmax and accumulation in fp32.
#pragma once

#include <cstddef>
#include <cstdint>

namespace treespec {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct TreeAttentionParams {
  const void* q = nullptr;       // [B, H, n, D]
  const void* k = nullptr;       // [B, Hkv, L, D]
  const void* v = nullptr;       // [B, Hkv, L, D]
  void* out = nullptr;           // [B, n, H, D], contiguous
  const uint64_t* bits = nullptr;  // [n, W] ancestor words (row stride W); nullptr = causal
  // element strides (the last dimension must be contiguous)
  int64_t q_stride_b = 0, q_stride_h = 0, q_stride_n = 0;
  int64_t k_stride_b = 0, k_stride_h = 0, k_stride_l = 0;
  int64_t v_stride_b = 0, v_stride_h = 0, v_stride_l = 0;
  int batch = 0, heads = 0, kv_heads = 0, n = 0, kv_len = 0, head_dim = 0, words = 0;
  // The row-invariant kernel (tree_attention_exact_cpu) only: the n queries are tokens query_offset ..
  // query_offset + n - 1 of a block of block_n tokens (0: n, offset 0) after kv_len - block_n committed keys;
  // their ancestor bits are rows query_offset.. of `bits` (a caller splits one block's queries into tasks).
  int block_n = 0, query_offset = 0;
  float scale = 1.0f;            // softmax scale applied to q.k
  DType dtype = DType::kFloat32;
  // The CPU kernels only: K / V held in bf16 under float32 q and out (a cache that stores K / V in half the
  // bytes); false: K / V in `dtype`.
  bool kv_bf16 = false;
  // CPU: run every task on the calling thread (a caller that is itself one thread of a parallel region,
  // e.g. the native step, must not open a nested one)
  bool serial = false;
  // CUDA split-K workspace (flash-decoding): splits > 1 needs work_o [B*n*H*splits*D] and
  // work_ml [B*n*H*splits*2] floats; see tree_attention_cuda_plan.
  int splits = 1;
  float* work_o = nullptr;
  float* work_ml = nullptr;
};

// Moves for the fused commit: for every tensor t (num_tensors of them: all layers' keys, then all
// layers' values, identical shapes [B, Hkv, max_len, D] and strides), for b, h, in order i = 0..m-1:
//   t[b, h, dst[i], :] = t[b, h, src[i], :]
// Applied in order, so a move may read a slot an earlier move wrote; the commit of an accepted tree
// path (dst increasing, src[i] >= dst[i]) never does, and equals gather-then-scatter.
constexpr int kCommitMaxTensors = 128;  // per launch; the launcher loops over larger lists

struct CommitParams {
  void* const* tensors = nullptr;  // host array of num_tensors base pointers
  int num_tensors = 0;
  const int64_t* src = nullptr;    // [m] slot indices (device memory on CUDA)
  const int64_t* dst = nullptr;    // [m]
  int moves = 0;
  int batch = 0, kv_heads = 0, head_dim = 0;
  int64_t stride_b = 0, stride_h = 0, stride_l = 0;  // element strides, the last dim contiguous
  int element_size = 4;            // bytes: 1, 2, 4 or 8 (a move copies raw bits)
};

// The CPU launchers (tree_attention_cpu.cpp): fp32 and bf16; parallel over at::parallel_for.
void tree_attention_cpu(const TreeAttentionParams& p);
void commit_kv_cpu(const CommitParams& p);

#if defined(TREESPEC_WITH_CUDA) || defined(__CUDACC__)
// The CUDA launchers (tree_attention_cuda.cu). Each returns 0 on success, a cudaError_t value from
// the launch, or a negative code for arguments the kernel does not support (see the error string).
// `stream` is a cudaStream_t.
bool tree_attention_cuda_supports(int head_dim, int group, DType dtype);
// How many key splits (flash-decoding) a launch on a device with `num_sms` multiprocessors uses.
int tree_attention_cuda_plan(const TreeAttentionParams& p, int num_sms);
int tree_attention_cuda(const TreeAttentionParams& p, void* stream);
int commit_kv_cuda(const CommitParams& p, void* stream);
const char* treespec_cuda_error_string(int code);
#endif

}  // namespace treespec
