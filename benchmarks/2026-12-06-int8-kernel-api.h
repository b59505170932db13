#pragma once
#include <cstdint>
struct KernelApi {
  void* (*repack)(bool q4, int64_t N, int64_t K, const void* q, const uint16_t* d, const uint16_t* m);
  void* (*quantize)(const float* x, int64_t M, int64_t K);
  // the same into an arena (nullptr: not in this kernel version; then `repack` owns its bytes)
  void* (*repack_into)(bool q4, int64_t N, int64_t K, const void* q, const uint16_t* d, const uint16_t* m,
                       uint8_t* into);
  int64_t (*bytes)(bool q4, int64_t N, int64_t K);
  void (*columns)(const void* w, const void* rows, int64_t M, float* out, int64_t ldo, int64_t n0, int64_t n1,
                  int engine);
};
extern KernelApi kernel_old, kernel_new;
