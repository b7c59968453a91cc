// What the CPU kernels share (cpu_attention.cpp, cpu_prefill.cpp, cpu_layers.cpp): head sizes, work balance and
// float helpers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

namespace pagedq {

// The head sizes the attention kernels are built for (the compiler knows D, so loops over it unroll and vectorize);
// other sizes go to the torch ops.
constexpr int64_t kHeadSizes[] = {16, 32, 64, 80, 96, 128, 256};

// Work items (by index) in `bins` lists of about equal cost, one per thread: costliest first, each to the least
// loaded bin. at::parallel_for cuts a range into equal runs of items, which leaves a thread waiting on the other
// when their items differ in cost (sequences of 20 and of 700 tokens).
inline std::vector<std::vector<int64_t>> balance(const std::vector<int64_t>& costs, int64_t bins) {
  std::vector<int64_t> order(costs.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return costs[a] > costs[b]; });
  std::vector<std::vector<int64_t>> out(std::max<int64_t>(bins, 1));
  std::vector<int64_t> load(out.size(), 0);
  for (const int64_t i : order) {
    const auto b = std::min_element(load.begin(), load.end()) - load.begin();
    out[b].push_back(i);
    load[b] += costs[i];
  }
  return out;
}

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

#if defined(__AVX512F__)
// 16 bfloat16 values as float32: a bfloat16 is the top half of its float32.
inline __m512 widen_bf16(__m256i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)); }

// A register of 32-bit words, each a pair of bfloat16 values, as two of float32: the first of each pair, the second.
inline void split_bf16_pairs(__m512i words, __m512& first, __m512& second) {
  first = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
  second = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
}

// 16 values from p as float32.
template <typename T>
inline __m512 load16(const T* p) {
  const auto* half = reinterpret_cast<const __m256i*>(p);
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return widen_bf16(_mm256_loadu_si256(half));
  } else {
    static_assert(std::is_same_v<T, c10::Half>, "load16: float, bfloat16 or half");
    return _mm512_cvtph_ps(_mm256_loadu_si256(half));
  }
}

// fast_exp, 16 lanes at a time.
inline __m512 exp16(__m512 x) {
  const __m512 y = _mm512_mul_ps(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f)),
                                 _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  for (const float c : {1.339887440266574e-3f, 9.618437357674640e-3f, 5.550332471162809e-2f, 2.402264791363012e-1f,
                        6.931472028550421e-1f, 1.f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
#endif

}  // namespace pagedq
