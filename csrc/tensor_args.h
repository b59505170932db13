// Tensor -> launcher-struct helpers shared by the CPU and CUDA bindings (needs ATen).
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "tree_attention.h"

namespace treespec {

inline DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "treespec::tree_attention: unsupported dtype ", t.scalar_type());
  }
  return DType::kFloat32;
}

// Holds the tensors the params point into (a copy only where the last dim was not contiguous).
struct AttentionArgs {
  at::Tensor q, k, v, bits, out;
  TreeAttentionParams p;
};

inline at::Tensor last_dim_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// out: a caller's [B, n, H, D] contiguous buffer of q's dtype and device, or undefined (allocate one).
inline AttentionArgs attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& bits, double scale,
                                    const at::Tensor& out = at::Tensor(), bool bf16_kv_ok = false) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "treespec::tree_attention: q [B, H, n, D], k and v [B, Hkv, L, D] expected; got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), "treespec::tree_attention: k ", k.sizes(), " and v ", v.sizes(), " differ");
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D, "treespec::tree_attention: q ", q.sizes(), " and k ", k.sizes(),
              " disagree on batch or head_dim");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "treespec::tree_attention: ", H, " query heads are not a multiple of ", Hkv,
              " kv heads");
  TORCH_CHECK(n >= 1 && L >= n, "treespec::tree_attention: need 1 <= n <= L, got n = ", n, ", L = ", L);
  const bool bf16_kv = bf16_kv_ok && q.scalar_type() == at::kFloat && k.scalar_type() == at::kBFloat16 &&
                       v.scalar_type() == at::kBFloat16;  // the row-invariant kernel: bf16 K/V under float32 q
  TORCH_CHECK((q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type()) || bf16_kv,
              "treespec::tree_attention: q, k, v dtypes differ");
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), "treespec::tree_attention: q, k, v devices differ");
  TORCH_CHECK(B * H * n * D < (int64_t{1} << 31) && L < (int64_t{1} << 31), "treespec::tree_attention: too large");
  AttentionArgs a;
  a.q = last_dim_contiguous(q);
  a.k = last_dim_contiguous(k);
  a.v = last_dim_contiguous(v);
  const int64_t words = (n + 63) / 64;
  if (bits.has_value() && bits->defined()) {
    TORCH_CHECK(bits->scalar_type() == at::kLong && bits->dim() == 2 && bits->size(0) == n && bits->size(1) >= words,
                "treespec::tree_attention: bits must be int64 [n, ceil(n / 64)] (treespec.tree.pack_bits), got ",
                bits->scalar_type(), " ", bits->sizes(), " for n = ", n);
    TORCH_CHECK(bits->device() == q.device(), "treespec::tree_attention: bits on ", bits->device(), ", q on ",
                q.device());
    a.bits = bits->contiguous();
  }
  if (out.defined()) {
    TORCH_CHECK(out.sizes() == at::IntArrayRef({B, n, H, D}) && out.is_contiguous() &&
                    out.scalar_type() == q.scalar_type() && out.device() == q.device(),
                "treespec::tree_attention_out: out must be a contiguous [B, n, H, D] = [", B, ", ", n, ", ", H, ", ", D,
                "] tensor of q's dtype and device, got ", out.sizes(), " ", out.scalar_type());
    a.out = out;
  } else {
    a.out = at::empty({B, n, H, D}, q.options());
  }
  TreeAttentionParams& p = a.p;
  p.q = a.q.data_ptr();
  p.k = a.k.data_ptr();
  p.v = a.v.data_ptr();
  p.out = a.out.data_ptr();
  p.kv_bf16 = bf16_kv;
  p.bits = a.bits.defined() ? reinterpret_cast<const uint64_t*>(a.bits.data_ptr<int64_t>()) : nullptr;
  p.q_stride_b = a.q.stride(0);
  p.q_stride_h = a.q.stride(1);
  p.q_stride_n = a.q.stride(2);
  p.k_stride_b = a.k.stride(0);
  p.k_stride_h = a.k.stride(1);
  p.k_stride_l = a.k.stride(2);
  p.v_stride_b = a.v.stride(0);
  p.v_stride_h = a.v.stride(1);
  p.v_stride_l = a.v.stride(2);
  p.batch = static_cast<int>(B);
  p.heads = static_cast<int>(H);
  p.kv_heads = static_cast<int>(Hkv);
  p.n = static_cast<int>(n);
  p.kv_len = static_cast<int>(L);
  p.head_dim = static_cast<int>(D);
  p.words = a.bits.defined() ? static_cast<int>(a.bits.size(1)) : static_cast<int>(words);
  p.scale = static_cast<float>(scale);
  p.dtype = dtype_of(q);
  return a;
}

// Checks the key / value lists of a fused commit and fills everything but the index pointers.
inline CommitParams commit_args(at::TensorList keys, at::TensorList values, const at::Tensor& src,
                                const at::Tensor& dst, std::vector<void*>& pointers) {
  TORCH_CHECK(keys.size() == values.size() && !keys.empty(),
              "treespec::commit_kv: need as many value tensors as key tensors (and at least one)");
  TORCH_CHECK(src.dim() == 1 && dst.dim() == 1 && src.numel() == dst.numel(),
              "treespec::commit_kv: src and dst must be 1-D with the same length");
  TORCH_CHECK(src.scalar_type() == at::kLong && dst.scalar_type() == at::kLong,
              "treespec::commit_kv: src and dst must be int64");
  const at::Tensor& first = keys[0];
  TORCH_CHECK(first.dim() == 4, "treespec::commit_kv: tensors must be [B, Hkv, max_len, D]");
  const int64_t es = first.element_size();
  TORCH_CHECK(es == 1 || es == 2 || es == 4 || es == 8, "treespec::commit_kv: 1-, 2-, 4- or 8-byte elements expected, got ",
              first.scalar_type());
  CommitParams p;
  pointers.clear();
  for (const at::TensorList& list : {keys, values}) {
    for (const at::Tensor& t : list) {
      TORCH_CHECK(t.sizes() == first.sizes() && t.strides() == first.strides() &&
                      t.scalar_type() == first.scalar_type() && t.device() == first.device(),
                  "treespec::commit_kv: every tensor must have the shape, strides, dtype and device of keys[0] (",
                  first.sizes(), ")");
      TORCH_CHECK(t.stride(3) == 1, "treespec::commit_kv: the head dim must be contiguous");
      pointers.push_back(t.data_ptr());
    }
  }
  TORCH_CHECK(src.device() == dst.device() && (src.is_cpu() || src.device() == first.device()),
              "treespec::commit_kv: src and dst must both be on the CPU or both on the device of the cache (",
              first.device(), "); got ", src.device(), " and ", dst.device());
  p.tensors = pointers.data();
  p.num_tensors = static_cast<int>(pointers.size());
  p.moves = static_cast<int>(src.numel());
  p.batch = static_cast<int>(first.size(0));
  p.kv_heads = static_cast<int>(first.size(1));
  p.head_dim = static_cast<int>(first.size(3));
  p.stride_b = first.stride(0);
  p.stride_h = first.stride(1);
  p.stride_l = first.stride(2);
  p.element_size = static_cast<int>(first.element_size());
  return p;
}

// Every move src[i] -> dst[i] of a commit must stay inside the cache's max_len slots (CPU int64 tensors,
// contiguous).
inline void check_moves(const at::Tensor& src, const at::Tensor& dst, int64_t max_len) {
  const int64_t* sp = src.data_ptr<int64_t>();
  const int64_t* dp = dst.data_ptr<int64_t>();
  for (int64_t i = 0; i < src.numel(); ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < max_len && dp[i] >= 0 && dp[i] < max_len, "treespec::commit_kv: move ",
                sp[i], " -> ", dp[i], " is outside the cache of ", max_len, " slots");
}

// tree_attention_rows (rows of a batch with their own committed lengths): checks rows and prefix_lens
// (int64 [A] CPU tensors) and calls run(q_a, k_a, v_a, out_a) once per row a on views: query row a
// [1, H, n, D], cache row rows[a] keys / values [0, prefix_lens[a] + n) as [1, Hkv, c_a + n, D], and
// out row a [1, n, H, D] of the returned out [A, n, H, D].
template <class Run>
at::Tensor for_each_row(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows,
                        const at::Tensor& prefix_lens, Run run) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "treespec::tree_attention_rows: q [A, H, n, D], k and v [B, Hkv, L, D] expected");
  const int64_t A = q.size(0), H = q.size(1), n = q.size(2), D = q.size(3);
  const int64_t B = k.size(0), L = k.size(2);
  TORCH_CHECK(rows.scalar_type() == at::kLong && prefix_lens.scalar_type() == at::kLong && rows.dim() == 1 &&
                  prefix_lens.dim() == 1 && rows.numel() == A && prefix_lens.numel() == A && rows.is_cpu() &&
                  prefix_lens.is_cpu(),
              "treespec::tree_attention_rows: rows and prefix_lens must be int64 [A] CPU tensors, A = ", A);
  const at::Tensor r = rows.contiguous(), c = prefix_lens.contiguous();
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t* cp = c.data_ptr<int64_t>();
  at::Tensor out = at::empty({A, n, H, D}, q.options());
  for (int64_t a = 0; a < A; ++a) {
    const int64_t row = rp[a], end = cp[a] + n;
    TORCH_CHECK(row >= 0 && row < B, "treespec::tree_attention_rows: row ", row, " outside a cache of ", B, " rows");
    TORCH_CHECK(cp[a] >= 0 && end <= L, "treespec::tree_attention_rows: row ", row, " reads keys up to ", end,
                " but the cache view holds ", L);
    run(q.narrow(0, a, 1), k.narrow(0, row, 1).narrow(2, 0, end), v.narrow(0, row, 1).narrow(2, 0, end),
        out.narrow(0, a, 1));
  }
  return out;
}

}  // namespace treespec
