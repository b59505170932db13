// One engine set of int8_linear_cpu.cpp behind a plain function table, compiled twice by
// 2026-12-06-int8-kernel-bench.sh: the working tree's kernel (KERNEL_API = kernel_new) and a baseline
// commit's (KERNEL_API = kernel_old, namespace renamed), so one binary times both interleaved.
#include "int8_linear_cpu.cpp"  // the kernel source itself (and its header beside it)

#include "2026-12-06-int8-kernel-api.h"

namespace {
treespec::LinearWeights blocks(bool q4, int64_t N, int64_t K, const void* q, const uint16_t* d, const uint16_t* m) {
  treespec::LinearWeights w;
  w.kind = q4 ? treespec::WeightKind::kQ4_1 : treespec::WeightKind::kQ8_0;
  w.N = N;
  w.K = K;
  w.w = q;
  w.d = d;
  w.m = m;
  w.half_scales = true;
  return w;
}
void* repack(bool q4, int64_t N, int64_t K, const void* q, const uint16_t* d, const uint16_t* m) {
  return new treespec::Int8Weights(treespec::repack_int8(blocks(q4, N, K, q, d, m)));
}
#if defined(KERNEL_ARENA)  // kernels from 2026-12-06 on: repack_int8(w, into), int8_bytes
void* repack_into(bool q4, int64_t N, int64_t K, const void* q, const uint16_t* d, const uint16_t* m, uint8_t* into) {
  return new treespec::Int8Weights(treespec::repack_int8(blocks(q4, N, K, q, d, m), into));
}
int64_t bytes(bool q4, int64_t N, int64_t K) { return treespec::int8_bytes(q4, N, K); }
#else
void* (*repack_into)(bool, int64_t, int64_t, const void*, const uint16_t*, const uint16_t*, uint8_t*) = nullptr;
int64_t (*bytes)(bool, int64_t, int64_t) = nullptr;
#endif
void* quantize(const float* x, int64_t M, int64_t K) {
  auto* rows = new treespec::QuantRows();
  rows->resize(M, K);
  for (int64_t r = 0; r < M; ++r) treespec::quantize_row(x + r * K, *rows, r);
  return rows;
}
void columns(const void* w, const void* rows, int64_t M, float* out, int64_t ldo, int64_t n0, int64_t n1, int engine) {
  treespec::int8_columns(*static_cast<const treespec::Int8Weights*>(w), *static_cast<const treespec::QuantRows*>(rows),
                         M, out, ldo, n0, n1, static_cast<treespec::Int8Engine>(engine));
}
}  // namespace

KernelApi KERNEL_API = {repack, quantize, repack_into, bytes, columns};
