// Linear layers whose float32 weights are exactly block-quantized values, read in that compact form.
// Plain C++ interface (raw pointers; no torch): kernel in block_linear_cpu.cpp, binding in bindings.cpp.
//
//   out[M, N] = x[M, K] @ w^T in float32, K a multiple of 32, b = k / 32:
//   q4: w[n, k] = fma(d[n, b], q, m[n, b]), q in [0, 15]; q4[n, 16 * b + j] holds q for k = 32b + j in its low
//       nibble and for k = 32b + 16 + j in its high nibble (j < 16)                       (GGUF Q4_1 values)
//   q8: w[n, k] = d[n, b] * q, q = q8[n, k] in [-127, 127]                                 (GGUF Q8_0 values)
//   d, m: [N, K / 32] float16 values stored as float32, so every weight is computed exactly.
//
// Row-invariant: each out[r, n] is one fixed sequence of fp32 operations on row r of x and weight row n,
// whatever M is, wherever the row sits in a tile, whichever columns a call covers and however many
// threads share the work.
#pragma once

#include <cstdint>
#include <cstring>

namespace treespec {

// The float value of float16 bits h (exact: every float16 value is a float32 value).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0 && mantissa == 0) {
    bits = sign;
  } else if (exponent == 0) {  // subnormal: normalise
    int e = -1;
    uint32_t m = mantissa;
    do { ++e; m <<= 1; } while ((m & 0x400u) == 0);
    bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3FFu) << 13);
  } else if (exponent == 31) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One weight matrix as the CPU linear kernels read it (block_linear_cpu.cpp, exact_linear_cpu.cpp).
enum class WeightKind : int { kFloat32 = 0, kBFloat16 = 1, kQ4_1 = 2, kQ8_0 = 3 };

struct LinearWeights {
  WeightKind kind = WeightKind::kFloat32;
  int64_t N = 0, K = 0;          // out_features, in_features
  const void* w = nullptr;       // dense [N, K] (float32 / bf16 bits) or the blocks' q (uint8 [N, K/2], int8 [N, K])
  const void* d = nullptr;       // [N, K / 32] block scales (blocks only): float32, or float16 bits
  const void* m = nullptr;       // [N, K / 32] block minimums (Q4_1 only), the same type
  bool half_scales = false;      // d and m hold float16 bits (the same values in half the bytes)
  const float* bias = nullptr;   // [N] float32, or nullptr
};

// Columns [n0, n1) of out[r * ldo + n] = x[r * K ..] . w[n] (+ bias[n]) for r < M, on the calling thread.
// Row-invariant (above) for every kind; the dense kinds sum as exact_linear_cpu does (exact.h).
void linear_columns(const LinearWeights& w, const float* x, int64_t M, float* out, int64_t ldo, int64_t n0,
                    int64_t n1);

// The whole product, parallel over columns (at::parallel_for); out [M, N] contiguous.
void q4_linear_cpu(const float* x, int64_t M, int64_t K, const uint8_t* q4, const float* d, const float* m,
                   float* out, int64_t N);
void q8_linear_cpu(const float* x, int64_t M, int64_t K, const int8_t* q8, const float* d, float* out, int64_t N);

}  // namespace treespec
