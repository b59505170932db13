// Row-invariant ("bitwise" mode) CPU kernels. Each output row is computed by one fixed sequence of fp32
// operations that depends on that row's own inputs only: never on how many rows share the call, where a
// row sits in a tile, or the thread count. A verification forward over N tree nodes then gives every node
// the bits a one-token forward gives it, so speculation cannot change the text of plain decoding.
//
//   exact_linear_cpu: out[M, N] = x[M, K] @ w[N, K]^T, w float32 or bf16 (exact widening), fp32 sums.
//   tree_attention_exact_cpu: the tree_attention.h contract; query token i sums over its visible keys in
//     one logical order (the committed prefix, then its ancestors and itself in block order), the order a
//     one-token step at the same position sums in. Two-pass softmax, no key splits, no tiles over keys.
#pragma once

#include <cstdint>

#include "tree_attention.h"

namespace treespec {

void exact_linear_cpu(const float* x, int64_t M, int64_t K, const void* w, bool w_bf16, float* out, int64_t N);
// Columns [n0, n1) of the same product into out[r * ldo + n], on the calling thread (same bits per element).
void exact_linear_columns(const float* x, int64_t M, int64_t K, const void* w, bool w_bf16, float* out, int64_t ldo,
                          int64_t n0, int64_t n1);
void tree_attention_exact_cpu(const TreeAttentionParams& p);

}  // namespace treespec
