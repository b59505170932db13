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
// Weight layout (`repack_int8`): panels of 32 weight rows (two groups of 16: one `vpdpbusd` lane per row),
// each a run of records, one per block of 32 k, so that the columns of a task are one sequential stream:
//   record (panel p, block b) = [group 0 quants][group 1 quants][d: 32 float16][m: 32 float16, Q4_1 only]
//     (Q4_1: 640 bytes, Q8: 1088 bytes; every part starts on a 64-byte line)
//   Q4_1 quants of a group: 4 chunks of 64 bytes; chunk j, byte 4c + i: q[n, 32b + 8j + i] in the low nibble,
//        q[n, 32b + 8j + 4 + i] in the high nibble (i < 4; n = 32p + 16g + c)
//   Q8 quants of a group: 8 chunks of 64 bytes; chunk j, byte 4c + i: q[n, 32b + 4j + i] + 128 (unsigned, so
//        that `vpdpbusd` multiplies it by the signed activations; the 128 * xsum that this adds is subtracted
//        from the integer sum)
//   d, m: lane 16g + c of the record (float16 bits). Rows past N (the last panel's padding) have q = 0, d = m = 0.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "block_linear.h"

namespace treespec {

// Bytes on 64-byte lines (and, from 2 MB up, on 2 MB pages with transparent huge pages asked for: a
// one-row step streams every weight once, and with 4 KB pages it walked a page table entry per 4 KB and
// lost the hardware prefetcher at every page end). Move-only.
class AlignedBytes {
 public:
  AlignedBytes() = default;
  explicit AlignedBytes(int64_t size) { allocate(size); }
  AlignedBytes(const AlignedBytes&) = delete;
  AlignedBytes& operator=(const AlignedBytes&) = delete;
  AlignedBytes(AlignedBytes&& other) noexcept { swap(other); }
  AlignedBytes& operator=(AlignedBytes&& other) noexcept {
    swap(other);
    return *this;
  }
  ~AlignedBytes();
  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  void allocate(int64_t size);
  void swap(AlignedBytes& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
  }
  uint8_t* data_ = nullptr;
  int64_t size_ = 0;
};

struct Int8Weights {
  static constexpr int64_t kPanel = 32;  // weight rows per panel (two groups of 16)
  bool q4 = false;                  // Q4_1 (scales and minimums) or Q8 (scales)
  int64_t N = 0, K = 0, panels = 0, blocks = 0;
  int64_t record = 0;               // bytes per (panel, block) record: 640 (Q4_1) or 1088 (Q8)
  const uint8_t* data = nullptr;    // [panels, blocks, record]: in `own`, or in the caller's arena
  AlignedBytes own;
  const float* bias = nullptr;      // [N] float32, or nullptr
  int64_t bytes() const { return panels * blocks * record; }
  int64_t group_quant_bytes() const { return q4 ? 256 : 512; }
  // record (panel p, block b)
  const uint8_t* at(int64_t p, int64_t b) const { return data + (p * blocks + b) * record; }
  // group g (of 16 rows; panel g / 2) of block b: its quants, its 16 scales d and (Q4_1) minimums m
  const uint8_t* quants(int64_t g, int64_t b) const { return at(g / 2, b) + (g % 2) * group_quant_bytes(); }
  const uint16_t* d(int64_t g, int64_t b) const {
    return reinterpret_cast<const uint16_t*>(at(g / 2, b) + 2 * group_quant_bytes()) + 16 * (g % 2);
  }
  const uint16_t* m(int64_t g, int64_t b) const { return d(g, b) + 32; }
};

// The int8 form of a linear held as Q4_1 or Q8_0 blocks (GGUF layout, float16 or float32 scales that hold
// float16 values); K a multiple of 32. Dense weights are quantized to Q8_0 blocks by the caller.
// into: nullptr (the form holds its own bytes), or int8_bytes(...) bytes on a 64-byte line that outlive it
// (one arena for a model's linears: 2 MB pages for all of them).
Int8Weights repack_int8(const LinearWeights& w, uint8_t* into = nullptr);
// The bytes of the int8 form of an [N, K] linear (a multiple of 64).
int64_t int8_bytes(bool q4, int64_t N, int64_t K);

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
