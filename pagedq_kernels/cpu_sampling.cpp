// Greedy token selection on the CPU: the index of each row's first maximum, as torch's max(dim=-1) gives it
// (a NaN counts as the maximum, the first one wins), in one vectorized pass. torch's own reduction runs at a few
// GB/s over a [batch, vocab] logits tensor, several milliseconds of every large decode step. Built with
// cpu_attention.cpp (kernels/cpu_ops.py); the op is torch.ops.pagedq.argmax_rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_library.h"
#include "cpu_math.h"

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// The plain loop from index `from`, given the best so far: the tail of a vectorized row, rows too short for a
// vector, CPUs without AVX-512, and rows holding a NaN (the first NaN wins, as in torch).
template <typename T>
int64_t scan_from(const T* row, int64_t from, int64_t n, int64_t best, float top) {
  for (int64_t i = from; i < n; ++i) {
    const float x = to_float(row[i]);
    if (std::isnan(x)) return i;
    if (x > top) {
      top = x;
      best = i;
    }
  }
  return best;
}

template <typename T>
int64_t first_max(const T* row, int64_t n) {
  const float first = to_float(row[0]);
  return std::isnan(first) ? 0 : scan_from(row, 1, n, 0, first);
}

#if defined(__AVX512F__)
using pagedq::load16;

// Per lane, the first maximum among the lane's elements (a strict > keeps the earlier index); then the largest
// lane value, and among lanes holding it the smallest index. A NaN anywhere hands the row to first_max.
template <typename T>
int64_t first_max_avx512(const T* row, int64_t n) {
  const int64_t full = n / 16 * 16;
  __m512 top = load16(row);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i at = idx;
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
  for (int64_t i = 16; i < full; i += 16) {
    at = _mm512_add_epi32(at, step);
    const __m512 x = load16(row + i);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __mmask16 more = _mm512_cmp_ps_mask(x, top, _CMP_GT_OQ);
    top = _mm512_mask_blend_ps(more, top, x);
    idx = _mm512_mask_blend_epi32(more, idx, at);
  }
  if (nan) return first_max(row, n);
  const float m = _mm512_reduce_max_ps(top);
  const __mmask16 holders = _mm512_cmp_ps_mask(top, _mm512_set1_ps(m), _CMP_EQ_OQ);
  // The tail comes after every lane's elements: only a larger value (or a NaN) wins over them.
  return scan_from(row, full, n, _mm512_mask_reduce_min_epi32(holders, idx), m);
}
#endif

template <typename T>
void argmax_all(const T* data, int64_t rows, int64_t n, int64_t stride, int64_t* out) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = data + r * stride;
#if defined(__AVX512F__)
      out[r] = n >= 16 ? first_max_avx512(row, n) : first_max(row, n);
#else
      out[r] = first_max(row, n);
#endif
    }
  });
}

}  // namespace

namespace pagedq {

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1,
              "argmax_rows: a [rows, vocab] tensor with contiguous, non-empty rows");
  auto out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  int64_t* o = out.data_ptr<int64_t>();
  switch (logits.scalar_type()) {
    case at::kFloat: argmax_all(logits.data_ptr<float>(), rows, n, stride, o); break;
    case at::kBFloat16: argmax_all(logits.data_ptr<c10::BFloat16>(), rows, n, stride, o); break;
    case at::kHalf: argmax_all(logits.data_ptr<c10::Half>(), rows, n, stride, o); break;
    default: TORCH_CHECK(false, "argmax_rows: float32, bfloat16 or float16 logits, not ", logits.scalar_type());
  }
  return out;
}

}  // namespace pagedq

TORCH_LIBRARY_IMPL(pagedq, CPU, m) {
  m.impl("argmax_rows", &pagedq::argmax_rows);
}
