// The elementwise parts of a decoder layer on the CPU, each one pass over its rows where torch makes several
// (RMSNorm: cast, square, mean, rsqrt, two products; rotary: a negated half, a concatenation, three products and a
// sum; SiLU-and-multiply in bfloat16: a SiLU tensor, then the product). Each rounds where the torch code it replaces
// rounds, so float32 models give the same numbers up to the order of a sum. Built with cpu_attention.cpp
// (kernels/cpu_ops.py); the ops are torch.ops.pagedq.*.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_library.h"
#include "cpu_math.h"

#include <cmath>

namespace {

// Rows of a [N, H] tensor whose last dimension is contiguous: the row stride is stride(0). With a residual, x is
// first added to it in place (rounded to T, as torch's sum is) and the sum is normalized.
template <typename T>
void norm_rows(const T* x, int64_t x_stride, T* residual, int64_t residual_stride, const T* w, float eps, int64_t n,
               int64_t h, T* out, int64_t out_stride) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      if (residual != nullptr) {
        T* sum = residual + r * residual_stride;
        for (int64_t i = 0; i < h; ++i) sum[i] = static_cast<T>(static_cast<float>(sum[i]) + static_cast<float>(xr[i]));
        xr = sum;
      }
      T* o = out + r * out_stride;
      float sq = 0.f;
      for (int64_t i = 0; i < h; ++i) sq += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(h) + eps);
      for (int64_t i = 0; i < h; ++i)
        o[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(static_cast<float>(xr[i]) * inv)));
    }
  });
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, ": a [N, H] tensor with contiguous rows");
}

void check_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  check_rows(x, "rms_norm x");
  check_rows(out, "rms_norm out");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "rms_norm: x, weight and out share a dtype");
  TORCH_CHECK(weight.numel() == x.size(1) && out.sizes() == x.sizes(), "rms_norm: shapes");
}

}  // namespace

namespace pagedq {

// out = weight * rmsnorm(x): x in float32, normalized, cast back, times the weight (transformers' order).
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out) {
  check_norm(x, weight, out);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), nullptr, 0, weight.data_ptr<scalar_t>(),
                        static_cast<float>(eps), x.size(0), x.size(1), out.data_ptr<scalar_t>(), out.stride(0));
  });
}

// residual += x (rounded as torch rounds the sum), then out = rms_norm(residual): a decoder layer's residual add
// and the next norm in one pass.
void add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps, at::Tensor out) {
  check_norm(x, weight, out);
  check_rows(residual, "rms_norm residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "add_rms_norm: residual");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), residual.data_ptr<scalar_t>(), residual.stride(0),
                        weight.data_ptr<scalar_t>(), static_cast<float>(eps), x.size(0), x.size(1),
                        out.data_ptr<scalar_t>(), out.stride(0));
  });
}

}  // namespace pagedq

namespace {

// One head's row rotated in place: x * cos + rotate_half(x) * sin, each product and the sum rounded to T as torch
// rounds its separate ops (no fused multiply-add: float32 gives torch's numbers exactly).
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate_row(T* __restrict r, const float* __restrict c,
                                                             const float* __restrict s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = static_cast<float>(r[i]), b = static_cast<float>(r[i + half]);
    const T cos_a = static_cast<T>(a * static_cast<float>(static_cast<T>(c[i])));
    const T sin_b = static_cast<T>(-b * static_cast<float>(static_cast<T>(s[i])));
    const T cos_b = static_cast<T>(b * static_cast<float>(static_cast<T>(c[i + half])));
    const T sin_a = static_cast<T>(a * static_cast<float>(static_cast<T>(s[i + half])));
    r[i] = static_cast<T>(static_cast<float>(cos_a) + static_cast<float>(sin_b));
    r[i + half] = static_cast<T>(static_cast<float>(cos_b) + static_cast<float>(sin_a));
  }
}

// x [T, H, D] rotated in place (rotate-half layout) by cos/sin [max_positions, D] (float32) at each token's
// position.
template <typename T>
void rotate_rows(T* x, int64_t tokens, int64_t heads, int64_t dim, int64_t token_stride, int64_t head_stride,
                 const int64_t* pos, const float* cos, const float* sin) {
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t hd = 0; hd < heads; ++hd)
        rotate_row(x + t * token_stride + hd * head_stride, cos + pos[t] * dim, sin + pos[t] * dim, dim / 2);
  });
}

}  // namespace

namespace pagedq {

void rotary(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x is [T, H, D] with contiguous heads");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "rotary: int64 positions");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(1) == x.size(2),
              "rotary: contiguous float32 cos/sin tables [max_positions, D]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    rotate_rows<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1),
                          positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>());
  });
}

#if defined(__AVX512F__)
// out = silu(gate) * up for x = [gate | up] rows, bfloat16: one pass where torch makes two (silu into a new
// tensor, then the product), rounding where torch rounds (the SiLU, then the product).
void silu_and_mul(const at::Tensor& x, at::Tensor out) {
  check_rows(x, "silu_and_mul x");
  check_rows(out, "silu_and_mul out");
  const int64_t n = x.size(0), inter = out.size(1);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "silu_and_mul: bfloat16");
  TORCH_CHECK(x.size(1) == 2 * inter && out.size(0) == n && inter % 16 == 0,
              "silu_and_mul: x [N, 2I] and out [N, I], I a multiple of 16");
  const auto* xp = x.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16 *gate = xp + r * x.stride(0), *up = gate + inter;
      at::BFloat16* o = op + r * out.stride(0);
      for (int64_t i = 0; i < inter; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i),
                            pagedq::silu_mul16(pagedq::load16(gate + i), pagedq::load16(up + i)));
    }
  });
}
#else
void silu_and_mul(const at::Tensor&, at::Tensor) { TORCH_CHECK(false, "silu_and_mul: not built without AVX-512"); }
#endif

bool silu_and_mul_built() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace pagedq

TORCH_LIBRARY_IMPL(pagedq, CPU, m) {
  m.impl("rms_norm", &pagedq::rms_norm);
  m.impl("add_rms_norm", &pagedq::add_rms_norm);
  m.impl("rotary", &pagedq::rotary);
  m.impl("silu_and_mul", &pagedq::silu_and_mul);
}
