// Greedy acceptance's argmax (argmax.h): row_max over a column range, and the op argmax_rows(x [..., V]) ->
// int64 [...] over whole rows, for logits the native step did not compute.
//
// Why a kernel: torch's max over one row of a 49,152-token vocabulary took ~120 us on the 2-core AVX2 EPYC
// (45-55 us a row at 4-16 rows); this takes ~14 us a row. A range is read twice: its maximum (NaN noticed on
// the way), then up to the first column that holds it; a range with a NaN is scanned once more for its
// first NaN. Without AVX2: the same passes, scalar.

#include <immintrin.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "argmax.h"

namespace treespec {

RowMax row_max(const float* x, int64_t n0, int64_t n1) {
  RowMax out;
  if (n0 >= n1) return out;
  int64_t i = n0;
  float best = -INFINITY;
  bool nan = false;
#if defined(__AVX2__)
  // pass 1: four running maxima (vmaxps) and a NaN flag (an unordered self-compare), 32 values a round
  __m256 top[4], unordered = _mm256_setzero_ps();
  for (int u = 0; u < 4; ++u) top[u] = _mm256_set1_ps(-INFINITY);
  for (; i + 32 <= n1; i += 32)
    for (int u = 0; u < 4; ++u) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * u);
      top[u] = _mm256_max_ps(top[u], v);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  const __m256 all = _mm256_max_ps(_mm256_max_ps(top[0], top[1]), _mm256_max_ps(top[2], top[3]));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, all);
  for (float lane : lanes) best = lane > best ? lane : best;
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n1; ++i) {
    nan = nan || std::isnan(x[i]);
    if (x[i] > best) best = x[i];
  }
  out.value = best;
  out.nan = nan;
  if (nan) {
    for (int64_t j = n0; j < n1; ++j)
      if (std::isnan(x[j])) {
        out.index = j;
        return out;
      }
  }
  // pass 2: the first column that holds the maximum
  int64_t j = n0;
#if defined(__AVX2__)
  const __m256 target = _mm256_set1_ps(best);
  for (; j + 8 <= n1; j += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), target, _CMP_EQ_OQ));
    if (hits != 0) {
      out.index = j + __builtin_ctz(hits);
      return out;
    }
  }
#endif
  for (; j < n1; ++j)
    if (x[j] == best) break;
  out.index = j;  // j < n1: best is one of the values
  return out;
}

void rows_argmax(const float* x, int64_t rows, int64_t V, int64_t* index) {
  // a row is a few microseconds: threads only for many rows
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) index[r] = row_max(x + r * V, 0, V).index;
  });
}

namespace {

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "treespec::argmax_rows takes float32 or bfloat16 CPU tensors, got ", x.scalar_type(), " on ",
              x.device());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "treespec::argmax_rows needs a non-empty last dimension, got ",
              x.sizes());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t V = xf.size(-1), rows = xf.numel() / V;
  std::vector<int64_t> shape(xf.sizes().begin(), xf.sizes().end() - 1);
  at::Tensor out = at::empty(shape, xf.options().dtype(at::kLong));
  rows_argmax(xf.data_ptr<float>(), rows, V, out.data_ptr<int64_t>());
  return out;
}

}  // namespace
}  // namespace treespec

TORCH_LIBRARY_FRAGMENT(treespec, m) {
  m.def("argmax_rows(Tensor x) -> Tensor", {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(treespec, CPU, m) { m.impl("argmax_rows", &treespec::argmax_rows); }
