// Linear layers whose float32 weights are exactly block-quantized values, read in that compact form.
// Plain C++ interface (raw pointers; no torch): kernel in block_linear_cpu.cpp, binding in bindings.cpp.
//
//   out[M, N] = x[M, K] @ w^T in float32, K a multiple of 32, b = k / 32:
//   q4: w[n, k] = fma(d[n, b], q, m[n, b]), q in [0, 15]; q4[n, 16 * b + j] holds q for k = 32b + j in its low
//       nibble and for k = 32b + 16 + j in its high nibble (j < 16)                       (GGUF Q4_1 values)
//   q8: w[n, k] = d[n, b] * q, q = q8[n, k] in [-127, 127]                                 (GGUF Q8_0 values)
//   d, m: [N, K / 32] float16 values stored as float32, so every weight is computed exactly.
#pragma once

#include <cstdint>

namespace treespec {

void q4_linear_cpu(const float* x, int64_t M, int64_t K, const uint8_t* q4, const float* d, const float* m,
                   float* out, int64_t N);
void q8_linear_cpu(const float* x, int64_t M, int64_t K, const int8_t* q8, const float* d, float* out, int64_t N);

}  // namespace treespec
