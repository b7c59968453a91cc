// What the CPU kernels share (cpu_attention.cpp, cpu_prefill.cpp, cpu_layers.cpp): head sizes and float helpers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pagedq {

// The head sizes the attention kernels are built for (the compiler knows D, so loops over it unroll and vectorize);
// other sizes go to the torch ops.
constexpr int64_t kHeadSizes[] = {16, 32, 64, 80, 96, 128, 256};

// exp(x) as 2^n * 2^f, 2^f by Cephes' exp2f polynomial on [-0.5, 0.5]: relative error about 2e-7, in plain float
// and integer arithmetic that the compiler vectorizes (the C library's expf is a call per value). x is clamped to
// [-87, 88], where 2^n stays a normal float: below, the result is within 2e-38 of 0; above, a softmax or SiLU
// never gets there (exp(88) is 1.6e38).
inline float fast_exp(float x) {
  const float y = std::min(std::max(x, -87.f), 88.f) * 1.44269504088896341f;
  const float n = std::floor(y + 0.5f);
  const float f = y - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

}  // namespace pagedq
