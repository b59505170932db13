// The torch binding: operator schemas (namespace `treespec`) and the CPU implementations.
// The CUDA implementations live in bindings_cuda.cpp, compiled only where torch has CUDA.
// Fake (meta) kernels for torch.compile are registered from Python (treespec/ops.py).

#include <torch/library.h>

#include <vector>

#include "block_linear.h"
#include "exact.h"
#include "tensor_args.h"
#include "tree_attention.h"

namespace treespec {
namespace {

at::Tensor run_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const std::optional<at::Tensor>& bits, double scale, const at::Tensor& out) {
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "treespec::tree_attention on CPU takes float32 or bfloat16, got ", q.scalar_type());
  AttentionArgs a = attention_args(q, k, v, bits, scale, out);
  tree_attention_cpu(a.p);
  return a.out;
}

at::Tensor tree_attention_cpu_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const std::optional<at::Tensor>& bits, double scale) {
  return run_cpu(q, k, v, bits, scale, at::Tensor());
}

void tree_attention_out_cpu_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& bits, double scale, const at::Tensor& out) {
  run_cpu(q, k, v, bits, scale, out);
}

// Rows of a batch with their own committed lengths: query row a reads cache row rows[a], keys
// [0, prefix_lens[a] + n), its tree block at [prefix_lens[a], prefix_lens[a] + n). q: [A, H, n, D];
// k, v: [B, Hkv, L, D] (views of the whole cache, L >= every row's end); rows, prefix_lens: int64 [A] on
// the CPU. Returns [A, n, H, D]. The kernel runs row by row on views of the cache (no K/V copy), each
// call parallel over its heads and keys.
at::Tensor tree_attention_rows_cpu_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const std::optional<at::Tensor>& bits, double scale, const at::Tensor& rows,
                                      const at::Tensor& prefix_lens) {
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "treespec::tree_attention_rows on CPU takes float32 or bfloat16, got ", q.scalar_type());
  return for_each_row(q, k, v, rows, prefix_lens,
                      [&](const at::Tensor& qa, const at::Tensor& ka, const at::Tensor& va, const at::Tensor& oa) {
                        tree_attention_cpu(attention_args(qa, ka, va, bits, scale, oa).p);
                      });
}

// The row-invariant kernel ("bitwise" mode, exact.h): same arguments and result as tree_attention.
at::Tensor tree_attention_exact_cpu_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const std::optional<at::Tensor>& bits, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "treespec::tree_attention_exact takes float32 or bfloat16, got ", q.scalar_type());
  AttentionArgs a = attention_args(q, k, v, bits, scale, at::Tensor(), /*bf16_kv_ok=*/true);
  tree_attention_exact_cpu(a.p);
  return a.out;
}

// tree_attention_rows through the row-invariant kernel.
at::Tensor tree_attention_exact_rows_cpu_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const std::optional<at::Tensor>& bits, double scale,
                                            const at::Tensor& rows, const at::Tensor& prefix_lens) {
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "treespec::tree_attention_exact_rows takes float32 or bfloat16, got ", q.scalar_type());
  return for_each_row(q, k, v, rows, prefix_lens,
                      [&](const at::Tensor& qa, const at::Tensor& ka, const at::Tensor& va, const at::Tensor& oa) {
                        tree_attention_exact_cpu(attention_args(qa, ka, va, bits, scale, oa, true).p);
                      });
}

// x [..., K] float32 @ w [N, K]^T (float32 or bfloat16) -> [..., N] float32, row-invariant (exact.h).
at::Tensor exact_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "treespec exact linear takes float32 x, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16,
              "treespec exact linear takes float32 or bfloat16 weights, got ", w.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(-1), "treespec exact linear: weight ", w.sizes(),
              " does not fit in_features ", x.size(-1));
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t K = x.size(-1), N = w.size(0), M = K == 0 ? 0 : xc.numel() / K;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  exact_linear_cpu(xc.data_ptr<float>(), M, K, wc.data_ptr(), w.scalar_type() == at::kBFloat16,
                   out.data_ptr<float>(), N);
  return out;
}

void commit_kv_cpu_op(at::TensorList keys, at::TensorList values, const at::Tensor& src, const at::Tensor& dst) {
  std::vector<void*> pointers;
  CommitParams p = commit_args(keys, values, src, dst, pointers);
  const at::Tensor s = src.contiguous(), d = dst.contiguous();
  check_moves(s, d, keys[0].size(2));
  p.src = s.data_ptr<int64_t>();
  p.dst = d.data_ptr<int64_t>();
  commit_kv_cpu(p);
}

// x [..., K] float32 -> out [..., N]; the weight tensors as `block_linear.h` says.
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
                        const std::optional<at::Tensor>& m) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && d.scalar_type() == at::kFloat,
              "treespec block linear takes float32 x and scales, got ", x.scalar_type(), ", ", d.scalar_type());
  const int64_t K = x.size(-1), N = q.size(0);
  const bool q4 = m.has_value();
  TORCH_CHECK(K % 32 == 0, "treespec block linear: in_features ", K, " is not a multiple of 32");
  TORCH_CHECK(q.is_contiguous() && d.is_contiguous() && q.dim() == 2 && q.size(1) == (q4 ? K / 2 : K),
              "treespec block linear: weight blocks of shape ", q.sizes(), " do not fit in_features ", K);
  TORCH_CHECK(q.scalar_type() == (q4 ? at::kByte : at::kChar), "treespec block linear: q4 weights are uint8, "
              "q8 weights int8; got ", q.scalar_type());
  TORCH_CHECK(d.numel() == N * (K / 32) && (!q4 || (m->is_contiguous() && m->numel() == d.numel() &&
                                                      m->scalar_type() == at::kFloat)),
              "treespec block linear: scales must be contiguous float32 [", N, ", ", K / 32, "]");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.numel() / K;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  if (q4)
    q4_linear_cpu(xc.data_ptr<float>(), M, K, q.data_ptr<uint8_t>(), d.data_ptr<float>(), m->data_ptr<float>(),
                  out.data_ptr<float>(), N);
  else
    q8_linear_cpu(xc.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), out.data_ptr<float>(), N);
  return out;
}

}  // namespace
}  // namespace treespec

TORCH_LIBRARY(treespec, m) {
  m.def(
      "tree_attention(Tensor q, Tensor k, Tensor v, Tensor? bits, float scale) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "tree_attention_out(Tensor q, Tensor k, Tensor v, Tensor? bits, float scale, Tensor(a!) out) -> ()",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "tree_attention_rows(Tensor q, Tensor k, Tensor v, Tensor? bits, float scale, Tensor rows, "
      "Tensor prefix_lens) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "commit_kv(Tensor(a!)[] keys, Tensor(b!)[] values, Tensor src, Tensor dst) -> ()",
      {at::Tag::pt2_compliant_tag});
  m.def("block_linear(Tensor x, Tensor q, Tensor d, Tensor? m) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("tree_attention_exact(Tensor q, Tensor k, Tensor v, Tensor? bits, float scale) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def(
      "tree_attention_exact_rows(Tensor q, Tensor k, Tensor v, Tensor? bits, float scale, Tensor rows, "
      "Tensor prefix_lens) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def("exact_linear(Tensor x, Tensor w) -> Tensor", {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(treespec, CPU, m) {
  m.impl("tree_attention", &treespec::tree_attention_cpu_op);
  m.impl("tree_attention_out", &treespec::tree_attention_out_cpu_op);
  m.impl("tree_attention_rows", &treespec::tree_attention_rows_cpu_op);
  m.impl("commit_kv", &treespec::commit_kv_cpu_op);
  m.impl("block_linear", &treespec::block_linear);
  m.impl("tree_attention_exact", &treespec::tree_attention_exact_cpu_op);
  m.impl("tree_attention_exact_rows", &treespec::tree_attention_exact_rows_cpu_op);
  m.impl("exact_linear", &treespec::exact_linear);
}
