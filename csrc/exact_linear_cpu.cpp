// Row-invariant linear layer (exact.h): out[M, N] = x[M, K] @ w[N, K]^T for float32 or bf16 weights.
//
// Every (row, output) dot product runs the same steps whatever M is: C vector accumulators over K in
// chunks of C * VL (chunk part c into accumulator c), the leftover whole vectors into accumulators 0, 1,
// ..., then ((acc0 + acc1) + (acc2 + acc3)), its lanes in the fixed pairwise order, and the scalar tail in
// order (one FMA each). Rows are tiled only to share the weight loads; a tile's rows never mix. Every
// multiply-add is an explicit FMA (vec.h's `fmadd`), not left to the compiler's contraction, which can
// differ between tiles of different row counts.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "exact.h"
#include "vec.h"

namespace treespec {
namespace {

constexpr int C = 4;  // accumulators per row
#if TREESPEC_VL == 16
constexpr int kRows = 4;  // rows per tile: 16 accumulators + 4 weight vectors + 1 load of 32 registers
#else
constexpr int kRows = 2;  // 8 + 4 + 1 of 16
#endif
constexpr int64_t kColumns = 16;  // weight rows per task: the task's x tile stays in L1 across them

// R rows of x against weight row w: out[r * N] for r < R.
template <int R, typename W>
inline void row_tile(const float* x, int64_t K, const W* w, float* out, int64_t N) {
  vf acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = splat(0.0f);
  int64_t k = 0;
  for (; k + C * VL <= K; k += C * VL) {
    vf wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load_floats(w + k + c * VL);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = fmadd(loadv(x + r * K + k + c * VL), wv[c], acc[r][c]);
  }
  for (int c = 0; k + VL <= K; k += VL, ++c) {  // at most C - 1 whole vectors left
    const vf wv = load_floats(w + k);
    for (int r = 0; r < R; ++r) acc[r][c] = fmadd(loadv(x + r * K + k), wv, acc[r][c]);
  }
  for (int r = 0; r < R; ++r) {
    float sum = lane_sum((acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3]));
    // the tail as explicit FMAs: left to the compiler, contraction of `sum += x * w` differed between
    // tiles of 1 and of 2 rows (AVX2, bf16 weights), and a row's bits with them
    for (int64_t j = k; j < K; ++j) sum = __builtin_fmaf(x[r * K + j], to_float<W>(w[j]), sum);
    out[r * N] = sum;
  }
}

template <typename W>
void columns(const float* x, int64_t M, int64_t K, const W* w, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  int64_t r = 0;
  for (; r + kRows <= M; r += kRows)
    for (int64_t n = n0; n < n1; ++n) row_tile<kRows, W>(x + r * K, K, w + n * K, out + r * ldo + n, ldo);
  for (int64_t n = n0; n < n1; ++n) {
    switch (M - r) {
      case 1: row_tile<1, W>(x + r * K, K, w + n * K, out + r * ldo + n, ldo); break;
      case 2: row_tile<2, W>(x + r * K, K, w + n * K, out + r * ldo + n, ldo); break;
      case 3: row_tile<3, W>(x + r * K, K, w + n * K, out + r * ldo + n, ldo); break;
      default: break;
    }
  }
}

template <typename W>
void linear(const float* x, int64_t M, int64_t K, const W* w, float* out, int64_t N) {
  const int64_t blocks = (N + kColumns - 1) / kColumns;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t block = first; block < last; ++block)
      columns<W>(x, M, K, w, out, N, block * kColumns, std::min(N, block * kColumns + kColumns));
  });
}

}  // namespace

void exact_linear_columns(const float* x, int64_t M, int64_t K, const void* w, bool w_bf16, float* out, int64_t ldo,
                          int64_t n0, int64_t n1) {
  if (w_bf16)
    columns<uint16_t>(x, M, K, static_cast<const uint16_t*>(w), out, ldo, n0, n1);
  else
    columns<float>(x, M, K, static_cast<const float*>(w), out, ldo, n0, n1);
}

void exact_linear_cpu(const float* x, int64_t M, int64_t K, const void* w, bool w_bf16, float* out, int64_t N) {
  if (w_bf16)
    linear<uint16_t>(x, M, K, static_cast<const uint16_t*>(w), out, N);
  else
    linear<float>(x, M, K, static_cast<const float*>(w), out, N);
}

}  // namespace treespec
