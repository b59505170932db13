// The torch binding of the CUDA kernels (compiled only where torch has CUDA; see treespec/ops.py).
// Schemas are defined in bindings.cpp; this file adds the CUDA implementations.

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <vector>

#include "tensor_args.h"
#include "tree_attention.h"

namespace treespec {
namespace {

at::Tensor run_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::optional<at::Tensor>& bits, double scale, const at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(q.device());
  AttentionArgs a = attention_args(q, k, v, bits, scale, out);
  TreeAttentionParams& p = a.p;
  TORCH_CHECK(tree_attention_cuda_supports(p.head_dim, p.heads / p.kv_heads, p.dtype),
              "treespec::tree_attention (CUDA) takes head_dim 64, 128 or 256 and at most 32 query heads per KV "
              "head; got head_dim ",
              p.head_dim, ", ", p.heads / p.kv_heads, " heads per KV head");
  int sms = 0;
  TORCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, q.device().index()) == cudaSuccess,
              "treespec::tree_attention (CUDA): cannot query the device");
  p.splits = tree_attention_cuda_plan(p, sms);
  TORCH_CHECK(static_cast<int64_t>(p.batch) * p.splits <= 65535, "treespec::tree_attention (CUDA): batch too large");
  at::Tensor work_o, work_ml;
  if (p.splits > 1) {
    const int64_t rows = static_cast<int64_t>(p.batch) * p.n * p.heads * p.splits;
    work_o = at::empty({rows * p.head_dim}, q.options().dtype(at::kFloat));
    work_ml = at::empty({rows * 2}, q.options().dtype(at::kFloat));
    p.work_o = work_o.data_ptr<float>();
    p.work_ml = work_ml.data_ptr<float>();
  }
  const int err = tree_attention_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "treespec::tree_attention (CUDA): ", treespec_cuda_error_string(err));
  return a.out;
}

at::Tensor tree_attention_cuda_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::optional<at::Tensor>& bits, double scale) {
  return run_cuda(q, k, v, bits, scale, at::Tensor());
}

void tree_attention_out_cuda_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::optional<at::Tensor>& bits, double scale, const at::Tensor& out) {
  run_cuda(q, k, v, bits, scale, out);
}

// Rows with their own committed lengths (see tree_attention_rows in bindings.cpp): one launch per row on
// views of the cache, all on the current stream. rows and prefix_lens are int64 [A] host tensors.
at::Tensor tree_attention_rows_cuda_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const std::optional<at::Tensor>& bits, double scale, const at::Tensor& rows,
                                       const at::Tensor& prefix_lens) {
  return for_each_row(q, k, v, rows, prefix_lens,
                      [&](const at::Tensor& qa, const at::Tensor& ka, const at::Tensor& va, const at::Tensor& oa) {
                        run_cuda(qa, ka, va, bits, scale, oa);
                      });
}

void commit_kv_cuda_op(at::TensorList keys, at::TensorList values, const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(!keys.empty(), "treespec::commit_kv: no tensors");
  const c10::cuda::CUDAGuard guard(keys[0].device());
  std::vector<void*> pointers;
  CommitParams p = commit_args(keys, values, src, dst, pointers);
  // The CPU op's bounds check, on the host: free for CPU index tensors (what TreeKVCache passes, uploaded
  // here), one synchronizing copy for index tensors already on the device.
  const at::Tensor src_host = src.to(at::kCPU).contiguous(), dst_host = dst.to(at::kCPU).contiguous();
  check_moves(src_host, dst_host, keys[0].size(2));
  const at::Tensor s = src.is_cpu() ? src_host.to(keys[0].device()) : src.contiguous();
  const at::Tensor d = dst.is_cpu() ? dst_host.to(keys[0].device()) : dst.contiguous();
  p.src = s.data_ptr<int64_t>();
  p.dst = d.data_ptr<int64_t>();
  const int err = commit_kv_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "treespec::commit_kv (CUDA): ", treespec_cuda_error_string(err));
}

}  // namespace
}  // namespace treespec

TORCH_LIBRARY_IMPL(treespec, CUDA, m) {
  m.impl("tree_attention", &treespec::tree_attention_cuda_op);
  m.impl("tree_attention_out", &treespec::tree_attention_out_cuda_op);
  m.impl("tree_attention_rows", &treespec::tree_attention_rows_cuda_op);
  m.impl("commit_kv", &treespec::commit_kv_cuda_op);
}
