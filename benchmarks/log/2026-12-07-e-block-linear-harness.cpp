// Harness of log 2026-12-07-e (not built by the project): times treespec::linear_columns, one thread, all
// columns of a Q4_1 weight with float16 scales (what the native step passes), at 1-16 rows. From the repository root:
//   TP=$(python -c "import torch, os; print(os.path.dirname(torch.__file__))")
//   g++ -O3 -march=native -mprefer-vector-width=512 -fopenmp -Icsrc -I$TP/include benchmarks/log/2026-12-07-e-block-linear-harness.cpp \
//     csrc/block_linear_cpu.cpp csrc/exact_linear_cpu.cpp -L$TP/lib -ltorch_cpu -lc10 -Wl,-rpath,$TP/lib -o h && ./h 576 100000
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include <immintrin.h>
#include "block_linear.h"
int main(int argc, char** argv) {
  const int64_t K = atoi(argv[1]), N = atoi(argv[2]);
  std::mt19937 g(1);
  std::vector<uint8_t> q(N * K / 2); for (auto& v : q) v = g();
  std::vector<uint16_t> d(N * K / 32), m(N * K / 32);
  for (auto& v : d) v = _cvtss_sh((g() % 1000) / 1e5f, 0);
  for (auto& v : m) v = _cvtss_sh(-(g() % 1000) / 1e4f, 0);
  std::vector<float> x(16 * K), out(16 * N);
  for (auto& v : x) v = (int(g() % 2001) - 1000) / 100.f;
  treespec::LinearWeights w; w.kind = treespec::WeightKind::kQ4_1; w.N = N; w.K = K; w.w = q.data(); w.d = d.data(); w.m = m.data(); w.half_scales = true;
  for (int rows : {1, 2, 3, 4, 6, 8, 16}) {
    double best = 1e9;
    for (int it = 0; it < 15; ++it) {
      auto t = std::chrono::steady_clock::now();
      treespec::linear_columns(w, x.data(), rows, out.data(), N, 0, N);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
    }
    printf("rows %2d: %.3f ns per block-row-row\n", rows, best * 1e9 / (double(N) * K / 32 * rows));
  }
}
