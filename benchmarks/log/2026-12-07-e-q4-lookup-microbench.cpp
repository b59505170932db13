// Throwaway microbenchmark of log 2026-12-07-e (not built by the project): one thread, K = 576, the float
// block kernel's one-weight-row-block inner loop in its variants (cvt: widen + convert, the kernel before;
// perm / bcast: 16-value table lookups; *-half: float16 scales per block; chunk: 16 blocks' scales at once).
//   g++ -O3 -march=native -mprefer-vector-width=512 2026-12-07-e-q4-lookup-microbench.cpp -o mb && ./mb 1536 && ./mb 200000
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#include <chrono>
#include <random>
#include <cmath>
#include <cstdlib>
typedef __m512 bvec;
constexpr int PV=2;
static const uint16_t* HD; static const uint16_t* HM;
template <int MODE>
inline void block_weights(const uint8_t* q, const float* d, const float* m, int64_t b, bvec w[PV]) {
  if (MODE==3 || MODE==4) {
    const int64_t i = (d - (const float*)nullptr);
    (void)i;
  }
  if (MODE==3) {
    const uint16_t* hd = reinterpret_cast<const uint16_t*>(d); const uint16_t* hm = reinterpret_cast<const uint16_t*>(m);
    const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(_cvtsh_ss(hd[b])), _mm512_setr_ps(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15), _mm512_set1_ps(_cvtsh_ss(hm[b])));
    const __m512i all = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * b)));
    const __m512i s0 = _mm512_setr_epi32(0,0,0,0,8,8,8,8,16,16,16,16,24,24,24,24);
    const __m512i s1 = _mm512_setr_epi32(4,4,4,4,12,12,12,12,20,20,20,20,28,28,28,28);
    w[0] = _mm512_permutexvar_ps(_mm512_srlv_epi32(all, s0), table);
    w[1] = _mm512_permutexvar_ps(_mm512_srlv_epi32(all, s1), table);
    return;
  }
  if (MODE==5 || MODE==6) {
    const uint16_t* hd = reinterpret_cast<const uint16_t*>(d); const uint16_t* hm = reinterpret_cast<const uint16_t*>(m);
    __m512 vd, vm;
    if (MODE==5) {  // broadcast word + convert
      vd = _mm512_cvtph_ps(_mm256_set1_epi16((short)hd[b]));
      vm = _mm512_cvtph_ps(_mm256_set1_epi16((short)hm[b]));
    } else {  // interleaved pairs at hd[2b], hd[2b+1]
      int32_t pair; memcpy(&pair, hd + 2*b, 4);
      const __m512 dm = _mm512_cvtph_ps(_mm256_set1_epi32(pair));
      vd = _mm512_moveldup_ps(dm); vm = _mm512_movehdup_ps(dm);
    }
    const __m512 table = _mm512_fmadd_ps(vd, _mm512_setr_ps(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15), vm);
    const __m512i all = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * b)));
    const __m512i s0 = _mm512_setr_epi32(0,0,0,0,8,8,8,8,16,16,16,16,24,24,24,24);
    const __m512i s1 = _mm512_setr_epi32(4,4,4,4,12,12,12,12,20,20,20,20,28,28,28,28);
    w[0] = _mm512_permutexvar_ps(_mm512_srlv_epi32(all, s0), table);
    w[1] = _mm512_permutexvar_ps(_mm512_srlv_epi32(all, s1), table);
    return;
  }
  if (MODE==4) {
    const uint16_t* hd = reinterpret_cast<const uint16_t*>(d); const uint16_t* hm = reinterpret_cast<const uint16_t*>(m);
    const __m512 vd = _mm512_set1_ps(_cvtsh_ss(hd[b]));
    const __m512i all = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * b)));
    const __m512i lo = _mm512_and_si512(all, _mm512_set1_epi32(0x0F));
    const __m512i hi = _mm512_srli_epi32(all, 4);
    const __m512 vm = _mm512_set1_ps(_cvtsh_ss(hm[b]));
    w[0] = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(lo), vm);
    w[1] = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(hi), vm);
    return;
  }
  if (MODE==0) {
    const __m512 vd = _mm512_set1_ps(d[b]);
    const __m512i all = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * b)));
    const __m512i lo = _mm512_and_si512(all, _mm512_set1_epi32(0x0F));
    const __m512i hi = _mm512_srli_epi32(all, 4);
    const __m512 vm = _mm512_set1_ps(m[b]);
    w[0] = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(lo), vm);
    w[1] = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(hi), vm);
  } else if (MODE==1) {
    const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(d[b]), _mm512_setr_ps(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15), _mm512_set1_ps(m[b]));
    const __m512i all = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * b)));
    w[0] = _mm512_permutexvar_ps(all, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(all, 4), table);
  } else if (MODE==2) {
    const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(d[b]), _mm512_setr_ps(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15), _mm512_set1_ps(m[b]));
    const __m512i all = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * b)));
    const __m512i s0 = _mm512_setr_epi32(0,0,0,0,8,8,8,8,16,16,16,16,24,24,24,24);
    const __m512i s1 = _mm512_setr_epi32(4,4,4,4,12,12,12,12,20,20,20,20,28,28,28,28);
    w[0] = _mm512_permutexvar_ps(_mm512_srlv_epi32(all, s0), table);
    w[1] = _mm512_permutexvar_ps(_mm512_srlv_epi32(all, s1), table);
  } else {
    abort();
  }
}
template <int R, int C, int MODE>
inline void tile(const float* x, int64_t K, const uint8_t* q, const float* d, const float* m, float* out, int64_t ldo) {
  const int64_t blocks = K / 32, row_bytes = K / 2;
  bvec acc[R][C][PV];
  for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) for (int v = 0; v < PV; ++v) acc[r][c][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    if ((b & 3) == 0) for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(q + c * row_bytes + 16 * b) + 8192, _MM_HINT_T0);
    bvec w[C][PV];
    for (int c = 0; c < C; ++c) block_weights<MODE>(q + c * row_bytes, d + c * blocks, m + c * blocks, b, w[c]);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * K + 32 * b;
      for (int v = 0; v < PV; ++v) { const bvec xv = _mm512_loadu_ps(xb + 16 * v);
        for (int c = 0; c < C; ++c) acc[r][c][v] = _mm512_fmadd_ps(xv, w[c][v], acc[r][c][v]); }
    }
  }
  for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) out[r * ldo + c] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][c][0], acc[r][c][1]));
}
template <int R, int C, int MODE>
void run(const float* x, int64_t K, const uint8_t* q, const float* d, const float* m, float* out, int64_t N) {
  const int sz = (MODE==3||MODE==4||MODE==5) ? 2 : (MODE==6 ? 4 : 4);
  for (int64_t n = 0; n + C <= N; n += C) tile<R,C,MODE>(x, K, q + n*K/2, (const float*)((const char*)d + sz*n*(K/32)), (const float*)((const char*)m + sz*n*(K/32)), out + n, N);
}
template <int R, int C>
inline void tile7(const float* x, int64_t K, const uint8_t* q, const uint16_t* hd, const uint16_t* hm, float* out, int64_t ldo) {
  const int64_t blocks = K / 32, row_bytes = K / 2;
  bvec acc[R][C][PV];
  alignas(64) float sd[C][16], sm[C][16];
  for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) for (int v = 0; v < PV; ++v) acc[r][c][v] = _mm512_setzero_ps();
  const __m512 values = _mm512_setr_ps(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15);
  const __m512i s0 = _mm512_setr_epi32(0,0,0,0,8,8,8,8,16,16,16,16,24,24,24,24);
  const __m512i s1 = _mm512_setr_epi32(4,4,4,4,12,12,12,12,20,20,20,20,28,28,28,28);
  for (int64_t b = 0; b < blocks; ++b) {
    if ((b & 15) == 0) {
      const int64_t left = blocks - b;
      const __mmask16 mask = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
      for (int c = 0; c < C; ++c) {
        _mm512_store_ps(sd[c], _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, hd + c * blocks + b)));
        _mm512_store_ps(sm[c], _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, hm + c * blocks + b)));
      }
    }
    if ((b & 3) == 0) for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(q + c * row_bytes + 16 * b) + 8192, _MM_HINT_T0);
    bvec w[C][PV];
    for (int c = 0; c < C; ++c) {
      const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(sd[c][b & 15]), values, _mm512_set1_ps(sm[c][b & 15]));
      const __m512i all = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * row_bytes + 16 * b)));
      w[c][0] = _mm512_permutexvar_ps(_mm512_srlv_epi32(all, s0), table);
      w[c][1] = _mm512_permutexvar_ps(_mm512_srlv_epi32(all, s1), table);
    }
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * K + 32 * b;
      for (int v = 0; v < PV; ++v) { const bvec xv = _mm512_loadu_ps(xb + 16 * v);
        for (int c = 0; c < C; ++c) acc[r][c][v] = _mm512_fmadd_ps(xv, w[c][v], acc[r][c][v]); }
    }
  }
  for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) out[r * ldo + c] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][c][0], acc[r][c][1]));
}
template <int R, int C>
void run7(const float* x, int64_t K, const uint8_t* q, const uint16_t* d, const uint16_t* m, float* out, int64_t N) {
  for (int64_t n = 0; n + C <= N; n += C) tile7<R,C>(x, K, q + n*K/2, d + n*(K/32), m + n*(K/32), out + n, N);
}
int main(int argc, char** argv) {
  int64_t K = 576, N = atoi(argv[1]);
  std::mt19937 g(1);
  std::vector<uint8_t> q(N*K/2); for (auto& v: q) v = g();
  std::vector<float> d(N*K/32), m(N*K/32), x(6*K); for (auto& v: d) v = (g()%1000)/1e5f; for (auto& v: m) v = -(g()%1000)/1e4f; for (auto& v: x) v = (int(g()%2001)-1000)/100.f;
  std::vector<float> o0(6*N), o1(6*N);
  std::vector<float> xp(6*K);
  for (int r=0;r<6;++r) for (int b=0;b<K/32;++b) for (int v=0;v<2;++v) for (int t=0;t<16;++t) xp[r*K+32*b+16*v+t] = x[r*K+32*b+16*v+4*(t%4)+t/4];
  auto bench = [&](auto fn, const char* name, int R) {
    double best = 1e9; for (int it=0; it<30; ++it) { auto t=std::chrono::steady_clock::now(); fn(); double s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t).count(); if (s<best) best=s; }
    double br = double(N)*K/32*R; printf("%-10s R=%d: %.3f ms  %.2f ns/block-row-row (%.2f cyc@3.5)\n", name, R, best*1e3, best*1e9/br, best*1e9/br*3.5);
  };
  bench([&]{ run<1,4,0>(x.data(),K,q.data(),d.data(),m.data(),o0.data(),N); }, "cvt", 1);
  bench([&]{ run<1,4,1>(x.data(),K,q.data(),d.data(),m.data(),o1.data(),N); }, "perm", 1);
  bench([&]{ run<1,4,0>(x.data(),K,q.data(),d.data(),m.data(),o0.data(),N); }, "cvt", 1);
  bench([&]{ run<1,4,1>(x.data(),K,q.data(),d.data(),m.data(),o1.data(),N); }, "perm", 1);
  printf("equal: %d\n", memcmp(o0.data(), o1.data(), N*4)==0);
  std::vector<uint16_t> hd(d.size()), hm(m.size()); for (size_t i=0;i<d.size();++i){hd[i]=_cvtss_sh(d[i],0); hm[i]=_cvtss_sh(m[i],0);}
  bench([&]{ run<1,4,4>(x.data(),K,q.data(),(const float*)hd.data(),(const float*)hm.data(),o1.data(),N); }, "cvt-half", 1);
  bench([&]{ run<1,4,3>(xp.data(),K,q.data(),(const float*)hd.data(),(const float*)hm.data(),o1.data(),N); }, "bcast-half", 1);
  bench([&]{ run<4,2,4>(x.data(),K,q.data(),(const float*)hd.data(),(const float*)hm.data(),o1.data(),N); }, "cvt-half", 4);
  bench([&]{ run<4,2,3>(xp.data(),K,q.data(),(const float*)hd.data(),(const float*)hm.data(),o1.data(),N); }, "bcast-half", 4);
  std::vector<uint16_t> hdm(2*d.size()); for (size_t i=0;i<d.size();++i){hdm[2*i]=hd[i]; hdm[2*i+1]=hm[i];}
  std::vector<float> o2(6*N);
  bench([&]{ run<1,4,5>(xp.data(),K,q.data(),(const float*)hd.data(),(const float*)hm.data(),o2.data(),N); }, "bc-bcw", 1);
  bench([&]{ run<1,4,6>(xp.data(),K,q.data(),(const float*)hdm.data(),(const float*)hdm.data(),o2.data(),N); }, "bc-pair", 1);
  bench([&]{ run<4,2,5>(xp.data(),K,q.data(),(const float*)hd.data(),(const float*)hm.data(),o2.data(),N); }, "bc-bcw", 4);
  bench([&]{ run<4,2,6>(xp.data(),K,q.data(),(const float*)hdm.data(),(const float*)hdm.data(),o2.data(),N); }, "bc-pair", 4);
  std::vector<float> o3(6*N);
  bench([&]{ run7<1,4>(xp.data(),K,q.data(),hd.data(),hm.data(),o3.data(),N); }, "chunk", 1);
  bench([&]{ run7<4,2>(xp.data(),K,q.data(),hd.data(),hm.data(),o3.data(),N); }, "chunk", 4);
  printf("chunk==bcw: %d\n", memcmp(o3.data(), o2.data(), 4*N*4)==0);
  bench([&]{ run<1,4,2>(xp.data(),K,q.data(),d.data(),m.data(),o1.data(),N); }, "bcast", 1);
  printf("pair==float: %d\n", memcmp(o1.data(), o2.data(), 4*N*4)==0);
  bench([&]{ run<1,4,2>(xp.data(),K,q.data(),d.data(),m.data(),o1.data(),N); }, "bcast", 1);
  { double md=0; for (int i=0;i<N;++i) md=fmax(md, fabs(o0[i]-o1[i])/(fabs(o0[i])+1e-3)); printf("bcast max rel diff %.3g\n", md);}
  bench([&]{ run<4,2,2>(xp.data(),K,q.data(),d.data(),m.data(),o1.data(),N); }, "bcast", 4);
  bench([&]{ run<4,2,0>(x.data(),K,q.data(),d.data(),m.data(),o0.data(),N); }, "cvt", 4);
  bench([&]{ run<4,2,1>(x.data(),K,q.data(),d.data(),m.data(),o1.data(),N); }, "perm", 4);
  printf("equal: %d\n", memcmp(o0.data(), o1.data(), 4*N*4)==0);
  bench([&]{ run<6,2,0>(x.data(),K,q.data(),d.data(),m.data(),o0.data(),N); }, "cvt", 6);
  bench([&]{ run<6,2,1>(x.data(),K,q.data(),d.data(),m.data(),o1.data(),N); }, "perm", 6);
  printf("equal: %d\n", memcmp(o0.data(), o1.data(), 6*N*4)==0);
}
