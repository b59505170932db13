// CUDA tree attention and fused KV commit (see tree_attention.h for the contract).
//
// Kernel: one thread block per (query tile, kv head, batch x key split). A query tile holds the G
// query heads of one KV group for nq = 32 / G consecutive query tokens (32 rows), so each K/V tile
// staged in shared memory serves every query head that reads that KV head. 4 warps of 32 lanes; warp
// w owns rows w, w + 4, ... (8 rows) and keeps their online-softmax state (max, sum, D / 32 output
// values per lane) in registers, in fp32.
//
// Per K/V tile of 32 keys: the block stages K (rows padded to D + 4 floats: conflict-free float4
// reads) and V in shared memory as fp32; for each of its rows a warp computes one score per lane
// (lane = key) against the row's q in shared memory, applies the mask (prefix keys always visible;
// tree keys through the row's 64-bit ancestor word, held in a register), updates the max and sum with
// warp shuffles, and accumulates P.V with lane = output dim. The tree block is tiled from c, so a tree
// tile lies inside one ancestor word.
//
// Split-K (flash-decoding): when there are too few blocks to fill the GPU (decode: n = 1), the prefix
// is split across blocks (grid.z = batch x splits); each writes its partial (max, sum, output) to a
// workspace, and a second kernel merges them.
//
// Layering: kernels + plain C++ launchers here (no torch headers: this file compiles standalone with
// `nvcc -c -arch=sm_90 -std=c++17 csrc/tree_attention_cuda.cu`), the torch binding in bindings_cuda.cpp.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "tree_attention.h"

namespace treespec {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = 8;
constexpr int kRows = kWarps * kRowsPerWarp;  // query rows (tokens x group heads) per block
constexpr int kTileKeys = 32;                 // keys per shared-memory tile: one per lane
constexpr int kMinSplitTiles = 8;             // a key split covers at least 256 keys
constexpr int kMaxSplits = 64;
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFull = 0xffffffffu;

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// Ancestor word w of query token i (bits j = 64 w + t); causal (bits == nullptr): j <= i.
__device__ __forceinline__ uint64_t mask_word(const uint64_t* bits, int words, int i, int w) {
  if (bits != nullptr) return bits[static_cast<int64_t>(i) * words + w];
  const int lo = 64 * w;
  if (i < lo) return 0;
  if (i - lo >= 63) return ~0ull;
  return (2ull << (i - lo)) - 1;
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    tree_attention_kernel(const TreeAttentionParams p, const int nq) {
  static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int DV = D / 32;      // output dims per lane
  constexpr int KS = D + 4;       // padded K row (floats)
  extern __shared__ float4 smem4[];
  float* qs = reinterpret_cast<float*>(smem4);  // [kRows][D], scaled by scale * log2(e)
  float* ks = qs + kRows * D;                   // [kTileKeys][KS]
  float* vs = ks + kTileKeys * KS;              // [kTileKeys][D]

  const int G = p.heads / p.kv_heads;
  const int splits = p.splits;
  const int b = blockIdx.z / splits;
  const int split = blockIdx.z % splits;
  const int kvh = blockIdx.y;
  const int i0 = blockIdx.x * nq;
  const int nqh = min(nq, p.n - i0);
  const int R = nqh * G;
  const int c = p.kv_len - p.n;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const float qscale = p.scale * kLog2e;

  const T* q = static_cast<const T*>(p.q);
  for (int idx = threadIdx.x; idx < kRows * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    float x = 0.0f;
    if (r < R) {
      const int ii = r / G, g = r % G;
      x = to_float<T>(q[b * p.q_stride_b + static_cast<int64_t>(kvh * G + g) * p.q_stride_h +
                        static_cast<int64_t>(i0 + ii) * p.q_stride_n + d]) *
          qscale;
    }
    qs[idx] = x;
  }

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][DV];
  uint64_t word[kRowsPerWarp];  // each row's current ancestor word (tree tiles)
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    m[rr] = -INFINITY;
    l[rr] = 0.0f;
    word[rr] = 0;
#pragma unroll
    for (int dv = 0; dv < DV; ++dv) acc[rr][dv] = 0.0f;
  }

  const T* kbase = static_cast<const T*>(p.k) + b * p.k_stride_b + kvh * p.k_stride_h;
  const T* vbase = static_cast<const T*>(p.v) + b * p.v_stride_b + kvh * p.v_stride_h;

  // This split's prefix keys [t_begin, t_end); the last split also takes the tree block [c, L).
  const int prefix_tiles = (c + kTileKeys - 1) / kTileKeys;
  const int per_split = (prefix_tiles + splits - 1) / splits;
  const int t_begin = split * per_split * kTileKeys;
  const int t_end = min(c, (split + 1) * per_split * kTileKeys);
  const int n_prefix = t_end > t_begin ? (t_end - t_begin + kTileKeys - 1) / kTileKeys : 0;
  // causal: keys after the block's last query are invisible to all its rows
  const int tree_end = p.bits == nullptr ? min(p.n, i0 + nqh) : p.n;
  const int n_tree = split == splits - 1 ? (tree_end + kTileKeys - 1) / kTileKeys : 0;

  for (int ti = 0; ti < n_prefix + n_tree; ++ti) {
    int k0, nk, j0;
    if (ti < n_prefix) {
      k0 = t_begin + ti * kTileKeys;
      nk = min(kTileKeys, t_end - k0);
      j0 = -1;
    } else {
      j0 = (ti - n_prefix) * kTileKeys;
      k0 = c + j0;
      nk = min(kTileKeys, p.n - j0);
    }
    __syncthreads();  // the previous tile is consumed (and q is staged, on the first pass)
    for (int idx = threadIdx.x; idx < kTileKeys * D; idx += kThreads) {
      const int t = idx / D, d = idx % D;
      float kx = 0.0f, vx = 0.0f;
      if (t < nk) {
        kx = to_float<T>(kbase[static_cast<int64_t>(k0 + t) * p.k_stride_l + d]);
        vx = to_float<T>(vbase[static_cast<int64_t>(k0 + t) * p.v_stride_l + d]);
      }
      ks[t * KS + d] = kx;
      vs[t * D + d] = vx;
    }
    if (j0 >= 0 && j0 % 64 == 0) {  // entering a new ancestor word: one load per row, into registers
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) {
        const int r = warp + kWarps * rr;
        word[rr] = r < R ? mask_word(p.bits, p.words, i0 + r / G, j0 / 64) : 0;
      }
    }
    __syncthreads();

#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = warp + kWarps * rr;
      if (r < R) {  // uniform across the warp
        const float4* q4 = reinterpret_cast<const float4*>(qs + r * D);
        const float4* k4 = reinterpret_cast<const float4*>(ks + lane * KS);
        float s = 0.0f;
#pragma unroll
        for (int d4 = 0; d4 < D / 4; ++d4) {
          const float4 a = q4[d4], k = k4[d4];
          s = fmaf(a.x, k.x, s);
          s = fmaf(a.y, k.y, s);
          s = fmaf(a.z, k.z, s);
          s = fmaf(a.w, k.w, s);
        }
        bool visible = lane < nk;
        if (j0 >= 0) visible = visible && ((word[rr] >> ((j0 % 64) + lane)) & 1ull);
        s = visible ? s : -INFINITY;
        const float m_new = fmaxf(m[rr], warp_max(s));
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row that saw nothing yet
        const float pr = exp2f(s - m_use);
        const float alpha = exp2f(m[rr] - m_use);
        l[rr] = l[rr] * alpha + warp_sum(pr);
        m[rr] = m_new;
#pragma unroll
        for (int dv = 0; dv < DV; ++dv) acc[rr][dv] *= alpha;
        for (int t = 0; t < nk; ++t) {
          const float pt = __shfl_sync(kFull, pr, t);
#pragma unroll
          for (int dv = 0; dv < DV; ++dv) acc[rr][dv] = fmaf(pt, vs[t * D + lane + 32 * dv], acc[rr][dv]);
        }
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int r = warp + kWarps * rr;
    if (r < R) {
      const int ii = r / G, g = r % G;
      const int64_t row = (static_cast<int64_t>(b) * p.n + i0 + ii) * p.heads + kvh * G + g;  // [B, n, H]
      if (splits == 1) {
        T* out = static_cast<T*>(p.out) + row * D;
        const float inv = 1.0f / l[rr];
#pragma unroll
        for (int dv = 0; dv < DV; ++dv) out[lane + 32 * dv] = from_float<T>(acc[rr][dv] * inv);
      } else {
        float* wo = p.work_o + (row * splits + split) * D;
#pragma unroll
        for (int dv = 0; dv < DV; ++dv) wo[lane + 32 * dv] = acc[rr][dv];
        if (lane == 0) {
          p.work_ml[(row * splits + split) * 2] = m[rr];
          p.work_ml[(row * splits + split) * 2 + 1] = l[rr];
        }
      }
    }
  }
}

// Merges the key splits: one warp per output row (b, i, h).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) combine_splits_kernel(const TreeAttentionParams p) {
  constexpr int DV = D / 32;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.n * p.heads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int splits = p.splits;
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, p.work_ml[(row * splits + s) * 2]);
  float l = 0.0f, acc[DV];
#pragma unroll
  for (int dv = 0; dv < DV; ++dv) acc[dv] = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float ms = p.work_ml[(row * splits + s) * 2];
    if (ms == -INFINITY) continue;  // this split saw no key of this row
    const float w = exp2f(ms - mx);
    l += w * p.work_ml[(row * splits + s) * 2 + 1];
    const float* wo = p.work_o + (row * splits + s) * D;
#pragma unroll
    for (int dv = 0; dv < DV; ++dv) acc[dv] = fmaf(w, wo[lane + 32 * dv], acc[dv]);
  }
  T* out = static_cast<T*>(p.out) + row * D;
  const float inv = 1.0f / l;
#pragma unroll
  for (int dv = 0; dv < DV; ++dv) out[lane + 32 * dv] = from_float<T>(acc[dv] * inv);
}

constexpr size_t smem_bytes(int D) {
  return sizeof(float) * (static_cast<size_t>(kRows) * D + static_cast<size_t>(kTileKeys) * (D + 4) +
                          static_cast<size_t>(kTileKeys) * D);
}

int query_tokens_per_block(int group) { return group >= kRows ? 1 : kRows / group; }

template <typename T, int D>
int launch_attention(const TreeAttentionParams& p, cudaStream_t stream) {
  const int G = p.heads / p.kv_heads;
  const int nq = query_tokens_per_block(G);
  const dim3 grid((p.n + nq - 1) / nq, p.kv_heads, p.batch * p.splits);
  const size_t smem = smem_bytes(D);
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(tree_attention_kernel<T, D>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  tree_attention_kernel<T, D><<<grid, kThreads, smem, stream>>>(p, nq);
  if (p.splits > 1) {
    const int64_t rows = static_cast<int64_t>(p.batch) * p.n * p.heads;
    combine_splits_kernel<T, D><<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, stream>>>(p);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_attention_dtype(const TreeAttentionParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_attention<T, 64>(p, stream);
    case 128: return launch_attention<T, 128>(p, stream);
    case 256: return launch_attention<T, 256>(p, stream);
    default: return -1;
  }
}

constexpr int kErrUnsupported = -1;
constexpr int kErrTooManyTensors = -2;

// One block per (b * Hkv + h, tensor); a thread per head-dim element walks the moves in order.
struct CommitLaunch {
  void* tensors[kCommitMaxTensors];
  const int64_t* src;
  const int64_t* dst;
  int moves, kv_heads, head_dim;
  int64_t stride_b, stride_h, stride_l;
};

template <typename E>
__global__ void commit_kv_kernel(const CommitLaunch a) {
  const int bh = blockIdx.x;
  const int b = bh / a.kv_heads, h = bh % a.kv_heads;
  E* base = static_cast<E*>(a.tensors[blockIdx.y]) + b * a.stride_b + h * a.stride_h;
  for (int d = threadIdx.x; d < a.head_dim; d += blockDim.x) {
    for (int i = 0; i < a.moves; ++i) base[a.dst[i] * a.stride_l + d] = base[a.src[i] * a.stride_l + d];
  }
}

template <typename E>
int launch_commit(const CommitParams& p, cudaStream_t stream) {
  CommitLaunch a;
  a.src = p.src;
  a.dst = p.dst;
  a.moves = p.moves;
  a.kv_heads = p.kv_heads;
  a.head_dim = p.head_dim;
  a.stride_b = p.stride_b;
  a.stride_h = p.stride_h;
  a.stride_l = p.stride_l;
  const int threads = p.head_dim >= 128 ? 128 : (p.head_dim + 31) / 32 * 32;
  for (int start = 0; start < p.num_tensors; start += kCommitMaxTensors) {
    const int count = p.num_tensors - start < kCommitMaxTensors ? p.num_tensors - start : kCommitMaxTensors;
    for (int i = 0; i < count; ++i) a.tensors[i] = p.tensors[start + i];
    const dim3 grid(static_cast<unsigned>(p.batch) * p.kv_heads, count);
    commit_kv_kernel<E><<<grid, threads, 0, stream>>>(a);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  return 0;
}

}  // namespace

bool tree_attention_cuda_supports(int head_dim, int group, DType dtype) {
  (void)dtype;  // fp32, fp16 and bf16 all run
  return (head_dim == 64 || head_dim == 128 || head_dim == 256) && group >= 1 && group <= kRows;
}

int tree_attention_cuda_plan(const TreeAttentionParams& p, int num_sms) {
  const int G = p.heads / p.kv_heads;
  const int nq = query_tokens_per_block(G);
  const int64_t blocks = static_cast<int64_t>((p.n + nq - 1) / nq) * p.kv_heads * p.batch;
  const int c = p.kv_len - p.n;
  const int prefix_tiles = (c + kTileKeys - 1) / kTileKeys;
  const int64_t want = 2 * static_cast<int64_t>(num_sms);  // two waves of blocks
  if (blocks >= want || prefix_tiles < 2 * kMinSplitTiles) return 1;
  int splits = static_cast<int>((want + blocks - 1) / blocks);
  splits = splits < prefix_tiles / kMinSplitTiles ? splits : prefix_tiles / kMinSplitTiles;
  splits = splits < kMaxSplits ? splits : kMaxSplits;
  if (static_cast<int64_t>(p.batch) * splits > 65535) splits = 65535 / p.batch;
  // every split must own at least one prefix tile: recount with the rounded-up tiles per split
  const int per_split = (prefix_tiles + splits - 1) / splits;
  splits = (prefix_tiles + per_split - 1) / per_split;
  return splits < 1 ? 1 : splits;
}

int tree_attention_cuda(const TreeAttentionParams& p, void* stream) {
  if (!tree_attention_cuda_supports(p.head_dim, p.heads / p.kv_heads, p.dtype)) return kErrUnsupported;
  if (p.splits > 1 && (p.work_o == nullptr || p.work_ml == nullptr)) return kErrUnsupported;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kFloat32: return launch_attention_dtype<float>(p, s);
    case DType::kFloat16: return launch_attention_dtype<__half>(p, s);
    case DType::kBFloat16: return launch_attention_dtype<__nv_bfloat16>(p, s);
  }
  return kErrUnsupported;
}

int commit_kv_cuda(const CommitParams& p, void* stream) {
  if (p.moves == 0 || p.num_tensors == 0) return 0;
  if (p.num_tensors < 0) return kErrTooManyTensors;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p.element_size) {
    case 1: return launch_commit<uint8_t>(p, s);
    case 2: return launch_commit<uint16_t>(p, s);
    case 4: return launch_commit<uint32_t>(p, s);
    case 8: return launch_commit<uint64_t>(p, s);
    default: return kErrUnsupported;
  }
}

const char* treespec_cuda_error_string(int code) {
  if (code == kErrUnsupported)
    return "unsupported arguments (head_dim must be 64, 128 or 256, at most 32 query heads per KV head; "
           "commit elements of 1, 2, 4 or 8 bytes)";
  if (code == kErrTooManyTensors) return "bad tensor count";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // namespace treespec
