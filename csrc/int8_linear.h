// int8 numerics: linear layers whose activations are quantized to 8 bits per row and per block of 32, and
// whose dot products against Q4_1 / Q8_0 weight blocks run in integers (AVX-512 VNNI `vpdpbusd`; the scalar
// reference computes the same bits). Plain C++ interface, no torch: int8_linear_cpu.cpp.
//
//   activations (one row x [K], block b = k / 32):  xd[b] = max|x| / 127,  xq[k] = round(x[k] / xd[b]) in
//       [-127, 127], xsum[b] = sum of the block's xq, xdsum[b] = xd[b] * xsum[b]           (quantize_rows)
//   weights, block b of row n:  Q4_1: w = d * q + m, q in [0, 15];  Q8_0: w = d * q, q in [-127, 127]
//   out[r, n] = acc after, for b = 0, 1, ..., K/32 - 1 in order (then + bias[n]):
//       isum = sum over the block of q[n, k] * xq[r, k]                       (an exact integer)
//       acc  = fma(float(isum), xd[r, b] * d[n, b], acc)
//       acc  = fma(xdsum[r, b], m[n, b], acc)                                 (Q4_1 only)
//
// Each output is that one fixed sequence of float operations on its row and its weight row, whatever the
// number of rows, the tile a row sits in or the columns a task covers: row-invariant, so a verified tree
// node gets exactly the bits of a one-token step in this mode. The SIMD kernel computes one column per lane
// with those very operations, so it equals the scalar reference bit for bit.
//
// Weight layout (`repack_int8`): the GGUF blocks regrouped by 16 weight rows, so that one 64-byte vector
// holds 4 consecutive k of 16 rows (one `vpdpbusd` lane per row):
//   Q4_1: group g, block b: 4 chunks of 64 bytes; chunk j, byte 4c + i: q[16g + c, 32b + 8j + i] in the low
//         nibble, q[16g + c, 32b + 8j + 4 + i] in the high nibble (i < 4)
//   Q8:   group g, block b: 8 chunks of 64 bytes; chunk j, byte 4c + i: q[16g + c, 32b + 4j + i] + 128
//         (unsigned, so that `vpdpbusd` multiplies it by the signed activations; the 128 * xsum that this
//         adds is subtracted from the integer sum)
//   scales d (and m) as float16 bits [groups, blocks, 16]; rows past N (the last group's padding) are 0.
#pragma once

#include <cstdint>
#include <vector>

#include "block_linear.h"

namespace treespec {

struct Int8Weights {
  bool q4 = false;                  // Q4_1 (scales and minimums) or Q8 (scales)
  int64_t N = 0, K = 0, groups = 0, blocks = 0;
  std::vector<uint8_t> quants;      // [groups, blocks, 256 (Q4_1) or 512 (Q8)]
  std::vector<uint16_t> d, m;       // [groups, blocks, 16] float16 bits (m: Q4_1 only)
  const float* bias = nullptr;      // [N] float32, or nullptr
  int64_t bytes() const { return static_cast<int64_t>(quants.size() + 2 * (d.size() + m.size())); }
};

// The int8 form of a linear held as Q4_1 or Q8_0 blocks (GGUF layout, float16 or float32 scales that hold
// float16 values); K a multiple of 32. Dense weights are quantized to Q8_0 blocks by the caller.
Int8Weights repack_int8(const LinearWeights& w);

// M rows of activations [M, K] in the int8 form (above).
struct QuantRows {
  int64_t K = 0, blocks = 0;
  std::vector<int8_t> q;            // [M, K]
  std::vector<float> d, dsum;       // [M, K / 32]
  std::vector<int32_t> sum;         // [M, K / 32]
  void resize(int64_t M, int64_t k) {
    K = k;
    blocks = k / 32;
    q.resize(M * K);
    d.resize(M * blocks);
    dsum.resize(M * blocks);
    sum.resize(M * blocks);
  }
};

// Blocks [b0, b1) of row r of x (x points at the row's element 0) into rows.
void quantize_blocks(const float* x, QuantRows& rows, int64_t r, int64_t b0, int64_t b1);
inline void quantize_row(const float* x, QuantRows& rows, int64_t r) { quantize_blocks(x, rows, r, 0, rows.blocks); }

// The kernels that compute int8_columns: the scalar reference, AVX2 and AVX-512 VNNI (the same bits).
enum class Int8Engine : int { kAuto = 0, kReference = 1, kAvx2 = 2, kVnni = 3 };
// The engines this build has, the fastest last (the reference is always there).
std::vector<Int8Engine> int8_engines();

// Columns [n0, n1) of out[r * ldo + n] for r < M (n0 a multiple of 16, n1 one too or N), on the calling
// thread; kAuto: the fastest engine here.
void int8_columns(const Int8Weights& w, const QuantRows& x, int64_t M, float* out, int64_t ldo, int64_t n0, int64_t n1,
                  Int8Engine engine = Int8Engine::kAuto);
// The same bits from plain scalar code over the repacked layout (the reference the tests compare with).
void int8_columns_reference(const Int8Weights& w, const QuantRows& x, int64_t M, float* out, int64_t ldo, int64_t n0,
                            int64_t n1);

}  // namespace treespec
