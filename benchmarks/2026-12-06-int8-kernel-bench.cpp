// Micro-benchmark of the int8 kernel (csrc/int8_linear_cpu.cpp) at SmolLM2-135M's shapes: the working
// tree's kernel against a baseline commit's, interleaved in one process, on one thread.
//   hot:  the weights of one linear, again and again (they sit in L2 / L3): G int8 products per second
//   cold: 1 row through copies of the weights that fill ~128 MB (read from DRAM), 1 and 2 threads in
//         tasks of 64 columns (the plain step's split): GB/s of weight bytes
// Before timing, both kernels' outputs are compared with the scalar reference: they must be equal bit for bit.
// Build and run: benchmarks/2026-12-06-int8-kernel-bench.sh [baseline commit]
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "2026-12-06-int8-kernel-api.h"

namespace {

constexpr int kReference = 1, kVnni = 3;

struct Blocks {  // GGUF-layout Q4_1 / Q8_0 blocks with float16 scales
  bool q4;
  int64_t N, K;
  std::vector<uint8_t> q;
  std::vector<uint16_t> d, m;
  int64_t bytes() const { return static_cast<int64_t>(q.size() + 2 * (d.size() + m.size())); }
};

Blocks random_blocks(bool q4, int64_t N, int64_t K, std::mt19937& gen) {
  Blocks b{q4, N, K, {}, {}, {}};
  b.q.resize(q4 ? N * K / 2 : N * K);
  std::uniform_int_distribution<int> byte(0, 255), q8(-127, 127);
  for (auto& v : b.q) v = static_cast<uint8_t>(q4 ? byte(gen) : static_cast<uint8_t>(static_cast<int8_t>(q8(gen))));
  std::uniform_real_distribution<float> scale(0.001f, 0.02f), minimum(-0.1f, 0.0f);
  b.d.resize(N * K / 32);
  for (auto& v : b.d) v = _cvtss_sh(scale(gen), 0);
  if (q4) {
    b.m.resize(N * K / 32);
    for (auto& v : b.m) v = _cvtss_sh(minimum(gen), 0);
  }
  return b;
}

double now_ns() { return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct Shape {
  const char* name;
  int64_t N, K;
  bool q4;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 5;
  const bool hot = std::getenv("NO_HOT") == nullptr;
  const std::vector<Shape> shapes = {{"q,o 576x576 Q4_1", 576, 576, true},   {"k,v 192x576 Q4_1", 192, 576, true},
                                     {"gate,up 1536x576 Q4_1", 1536, 576, true}, {"down 576x1536 Q4_1", 576, 1536, true},
                                     {"lm_head 49152x576 Q8_0", 49152, 576, false}};
  const std::vector<int64_t> row_counts = {1, 2, 4, 8, 16};
  KernelApi* apis[2] = {&kernel_old, &kernel_new};
  std::mt19937 gen(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  bool all_equal = true;

  std::printf("hot, 1 thread: G int8 products / s (median of %d), old = baseline, new = working tree\n", repeats);
  std::printf("%-24s %5s %9s %9s %7s\n", "shape", "rows", "old", "new", "new/old");
  for (const Shape& s : shapes) {
    if (!hot) break;
    const Blocks b = random_blocks(s.q4, s.N, s.K, gen);
    void* w[2];
    for (int a = 0; a < 2; ++a) w[a] = apis[a]->repack(s.q4, s.N, s.K, b.q.data(), b.d.data(), s.q4 ? b.m.data() : nullptr);
    for (int64_t M : row_counts) {
      std::vector<float> x(M * s.K);
      for (auto& v : x) v = normal(gen);
      void* rows[2];
      for (int a = 0; a < 2; ++a) rows[a] = apis[a]->quantize(x.data(), M, s.K);
      std::vector<float> out(M * s.N), reference(M * s.N);
      // bit-for-bit check against the reference (the new build's), both builds
      kernel_new.columns(w[1], rows[1], M, reference.data(), s.N, 0, s.N, kReference);
      for (int a = 0; a < 2; ++a) {
        std::fill(out.begin(), out.end(), 0.0f);
        apis[a]->columns(w[a], rows[a], M, out.data(), s.N, 0, s.N, kVnni);
        if (std::memcmp(out.data(), reference.data(), sizeof(float) * out.size()) != 0) {
          std::printf("MISMATCH %s rows %ld kernel %s\n", s.name, static_cast<long>(M), a ? "new" : "old");
          all_equal = false;
        }
      }
      // iterations for ~15 ms per measurement
      const double products = static_cast<double>(M) * s.N * s.K;
      const int iters = std::max(1, static_cast<int>(15e-3 * 100e9 / products));
      std::vector<double> rate[2];
      for (int rep = 0; rep < repeats; ++rep)
        for (int a = 0; a < 2; ++a) {
          const double t0 = now_ns();
          for (int i = 0; i < iters; ++i) apis[a]->columns(w[a], rows[a], M, out.data(), s.N, 0, s.N, kVnni);
          rate[a].push_back(products * iters / (now_ns() - t0));
        }
      const double o = median(rate[0]), n = median(rate[1]);
      std::printf("%-24s %5ld %9.1f %9.1f %6.2fx\n", s.name, static_cast<long>(M), o, n, n / o);
      std::fflush(stdout);
      if (M == 16) {  // the same in tasks of 32 columns, one call each (a multi-row step's split)
        std::vector<double> split[2];
        for (int rep = 0; rep < repeats; ++rep)
          for (int a = 0; a < 2; ++a) {
            const double t0 = now_ns();
            for (int i = 0; i < iters; ++i)
              for (int64_t c = 0; c < s.N; c += 32)
                apis[a]->columns(w[a], rows[a], M, out.data(), s.N, c, std::min(s.N, c + 32), kVnni);
            split[a].push_back(products * iters / (now_ns() - t0));
          }
        const double so = median(split[0]), sn = median(split[1]);
        std::printf("%-24s %5s %9.1f %9.1f %6.2fx\n", s.name, "16/32c", so, sn, sn / so);
      }
    }
  }

  // cold: one row, the weights read from DRAM. Copies of a layer's q, k, v, o, gate, up, down in turn.
  std::printf("\ncold, 1 row, tasks of 64 columns: GB/s of weight bytes (median of %d)\n", repeats);
  std::printf("%-24s %7s %9s %9s %7s\n", "weights", "threads", "old", "new", "new/old");
  struct Linear {
    void* w[2];
    int64_t N, K;
    int64_t bytes;
  };
  const std::vector<Shape> layer = {{"q", 576, 576, true},     {"k", 192, 576, true},    {"v", 192, 576, true},
                                    {"o", 576, 576, true},     {"gate", 1536, 576, true}, {"up", 1536, 576, true},
                                    {"down", 576, 1536, true}};
  // as the native step holds them: in one arena on 2 MB pages where the kernel version takes one
  std::vector<Linear> linears;
  int64_t total = 0, arena_bytes[2] = {0, 0};
  while (total < (int64_t{128} << 20))
    for (const Shape& s : layer) {
      linears.push_back(Linear{{}, s.N, s.K, 0});
      for (int a = 0; a < 2; ++a)
        if (apis[a]->bytes != nullptr) arena_bytes[a] += apis[a]->bytes(s.q4, s.N, s.K);
      total += s.N * s.K * 5 / 8;  // Q4_1: 20 bytes per 32 weights
    }
  uint8_t* arena[2] = {nullptr, nullptr};
  for (int a = 0; a < 2; ++a)
    if (arena_bytes[a] > 0) {
      const size_t huge = size_t{2} << 20, size = (arena_bytes[a] + huge - 1) / huge * huge;
      void* p = nullptr;
      if (posix_memalign(&p, huge, size) != 0) return 2;
      madvise(p, size, MADV_HUGEPAGE);
      arena[a] = static_cast<uint8_t*>(p);
    }
  {
    int64_t offset[2] = {0, 0}, i = 0;
    while (i < static_cast<int64_t>(linears.size()))
      for (const Shape& s : layer) {
        if (i >= static_cast<int64_t>(linears.size())) break;
        const Blocks b = random_blocks(s.q4, s.N, s.K, gen);
        for (int a = 0; a < 2; ++a) {
          if (arena[a] != nullptr) {
            linears[i].w[a] = apis[a]->repack_into(s.q4, s.N, s.K, b.q.data(), b.d.data(), b.m.data(), arena[a] + offset[a]);
            offset[a] += apis[a]->bytes(s.q4, s.N, s.K);
          } else {
            linears[i].w[a] = apis[a]->repack(s.q4, s.N, s.K, b.q.data(), b.d.data(), b.m.data());
          }
        }
        ++i;
      }
  }
  std::vector<float> x(1536), out(1536);
  for (auto& v : x) v = normal(gen);
  void* rows576[2];
  void* rows1536[2];
  for (int a = 0; a < 2; ++a) {
    rows576[a] = apis[a]->quantize(x.data(), 1, 576);
    rows1536[a] = apis[a]->quantize(x.data(), 1, 1536);
  }
  for (int threads : {1, 2}) {
    std::vector<double> rate[2];
    for (int rep = 0; rep < repeats; ++rep)
      for (int a = 0; a < 2; ++a) {
        const double t0 = now_ns();
        for (const Linear& l : linears) {
          const int64_t tasks = (l.N + 63) / 64;
          void* rows = l.K == 576 ? rows576[a] : rows1536[a];
#pragma omp parallel for num_threads(threads) schedule(dynamic)
          for (int64_t t = 0; t < tasks; ++t)
            apis[a]->columns(l.w[a], rows, 1, out.data(), l.N, 64 * t, std::min(l.N, 64 * t + 64), kVnni);
        }
        rate[a].push_back(static_cast<double>(total) / (now_ns() - t0));
      }
    const double o = median(rate[0]), n = median(rate[1]);
    std::printf("%-24s %7d %9.1f %9.1f %6.2fx\n", "layers Q4_1, 128 MB", threads, o, n, n / o);
    std::fflush(stdout);
  }
  // the lm_head (Q8, 30 MB): copies that fill ~120 MB, one row, tasks of 256 columns (the logits call's)
  {
    std::vector<void*> heads[2];
    int64_t head_bytes = 0;
    for (int i = 0; i < 4; ++i) {
      const Blocks b = random_blocks(false, 49152, 576, gen);
      for (int a = 0; a < 2; ++a) heads[a].push_back(apis[a]->repack(false, 49152, 576, b.q.data(), b.d.data(), nullptr));
      head_bytes += b.bytes();
    }
    std::vector<float> logits(49152);
    for (int threads : {1, 2}) {
      std::vector<double> rate[2];
      for (int rep = 0; rep < repeats; ++rep)
        for (int a = 0; a < 2; ++a) {
          const double t0 = now_ns();
          for (void* w : heads[a]) {
#pragma omp parallel for num_threads(threads) schedule(dynamic)
            for (int64_t t = 0; t < 49152 / 256; ++t)
              apis[a]->columns(w, rows576[a], 1, logits.data(), 49152, 256 * t, 256 * t + 256, kVnni);
          }
          rate[a].push_back(static_cast<double>(head_bytes) / (now_ns() - t0));
        }
      const double o = median(rate[0]), n = median(rate[1]);
      std::printf("%-24s %7d %9.1f %9.1f %6.2fx\n", "lm_head Q8_0, 4 x 30 MB", threads, o, n, n / o);
      std::fflush(stdout);
    }
  }
  std::printf(all_equal ? "\nold and new VNNI kernels equal the scalar reference bit for bit\n" : "\nMISMATCHES (above)\n");
  return all_equal ? 0 : 1;
}
