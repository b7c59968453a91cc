// Linear layers on weights kept quantized (GGUF Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks, int8 per channel), multiplied
// with AVX-512 VNNI integer dot products. A decode step reads every weight once, so its pace is bytes over memory
// bandwidth: 4-bit weights are read as 0.75 bytes, 8-bit as 1.25 (1.5 for Q6_K), against bfloat16's 2.
//
// kernels/quant_layout.py repacks a format's blocks, losslessly, into one layout of this file: each weight is
// scale * u + min, u an unsigned 4- or 8-bit integer, with a float32 scale and min per output column and block of B
// inputs (B = 32, or 16 for Q6_K's sub-blocks). Output columns go in panels of 16; a panel holds, block after block,
// the block's u as B/4 registers of 16 columns by 4 inputs (4-bit: two such registers a register, the first in the
// low nibbles), then its 16 scales, then its 16 mins. One vpdpbusd multiplies a register by 4 inputs of a row.
//
// Activations are quantized per row and block to int8 (x ~ dx * qx, dx = max|x| / 127), as llama.cpp does, so a
// block's sum is scale * dx * sum(u * qx) + min * dx * sum(qx): integer dot products, then two multiply-adds. The
// rounding of x to int8 is the only error against a float matmul of the same weights.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_library.h"
#include "cpu_math.h"

namespace {

constexpr int64_t kCols = 16;  // output columns a panel

// The three layouts, told apart by a panel's bytes per input (K): 4-bit and 8-bit u in blocks of 32, 8-bit in 16.
struct Layout {
  int64_t bits, block;
  int64_t quant_bytes() const { return block * kCols * bits / 8; }
  int64_t block_bytes() const { return quant_bytes() + 2 * kCols * 4; }
  int64_t panel_bytes(int64_t k) const { return k / block * block_bytes(); }
};

constexpr Layout kLayouts[] = {{4, 32}, {8, 32}, {8, 16}};

Layout layout_of(int64_t panel_bytes, int64_t k) {
  for (const Layout& l : kLayouts)
    if (k % l.block == 0 && l.panel_bytes(k) == panel_bytes) return l;
  TORCH_CHECK(false, "quant_linear: ", panel_bytes, " bytes a panel fit no layout for K = ", k);
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
// A row block's activations as int8: qx (K values, read as 32-bit words of 4), and per block dx and dx * sum(qx).
struct Activations {
  int64_t k, block;
  std::vector<int8_t> q;
  std::vector<float> scale, scaled_sum;

  Activations(int64_t rows, int64_t k, int64_t block)
      : k(k), block(block), q(rows * k), scale(rows * (k / block)), scaled_sum(rows * (k / block)) {}

  const int32_t* words(int64_t row) const { return reinterpret_cast<const int32_t*>(q.data() + row * k); }

  // Row `row` of x quantized, 16 inputs a register (a block is 16 or 32 inputs): a decode step of 16 rows
  // quantizes ~50,000 inputs a layer, too many for a scalar loop.
  template <typename T>
  void quantize(int64_t row, const T* x) {
    const int64_t blocks = k / block, regs = block / 16;
    for (int64_t b = 0; b < blocks; ++b) {
      __m512 v[2];
      __m512 amax = _mm512_setzero_ps();
      for (int64_t i = 0; i < regs; ++i) {
        v[i] = pagedq::load16(x + b * block + i * 16);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
      }
      const float m = _mm512_reduce_max_ps(amax), d = m / 127.f, inv = m > 0.f ? 127.f / m : 0.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < regs; ++i) {
        // rounded to nearest even (the MXCSR default), as std::nearbyint and torch.round
        const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(inv)));
        sum += _mm512_reduce_add_epi32(qi);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + row * k + b * block + i * 16), _mm512_cvtepi32_epi8(qi));
      }
      scale[row * blocks + b] = d;
      scaled_sum[row * blocks + b] = d * static_cast<float>(sum);
    }
  }
};

struct QuantGemm {
  Layout layout;
  int64_t k, width;
  const uint8_t* panels;
  const float* bias;

  int64_t blocks() const { return k / layout.block; }
  const uint8_t* panel(int64_t p) const { return panels + p * layout.panel_bytes(k); }

  // The register of u for 4 inputs (quad j of a block) of the panel's 16 columns.
  __m512i weights(const uint8_t* q, int64_t j) const {
    if (layout.bits == 8) return _mm512_loadu_si512(q + j * 64);
    const __m512i both = _mm512_loadu_si512(q + (j / 2) * 64), low = _mm512_set1_epi8(0x0f);
    return j % 2 ? _mm512_and_si512(_mm512_srli_epi16(both, 4), low) : _mm512_and_si512(both, low);
  }

  // Sums of rows [first, first + R) over panel p, as 16 columns each.
  template <int R>
  void sum_rows(const Activations& a, int64_t p, int64_t first, __m512* out) const {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const int32_t* x[R];
    for (int r = 0; r < R; ++r) x[r] = a.words(first + r);
    const int64_t quads = layout.block / 4, nb = blocks();
    const uint8_t* q = panel(p);
    for (int64_t b = 0; b < nb; ++b, q += layout.block_bytes()) {
      __m512i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
      for (int64_t j = 0; j < quads; ++j) {
        const __m512i w = weights(q, j);
        for (int r = 0; r < R; ++r) dot[r] = _mm512_dpbusd_epi32(dot[r], w, _mm512_set1_epi32(x[r][b * quads + j]));
      }
      const auto* scales = reinterpret_cast<const float*>(q + layout.quant_bytes());
      const __m512 scale = _mm512_loadu_ps(scales), min = _mm512_loadu_ps(scales + kCols);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (first + r) * nb + b;
        const __m512 scaled = _mm512_mul_ps(scale, _mm512_set1_ps(a.scale[at]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), scaled, acc[r]);
        acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(a.scaled_sum[at]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r];
  }

  template <int R = 8>
  void sum_block(const Activations& a, int64_t p, int64_t first, int64_t count, __m512* out) const {
    if constexpr (R > 1) {
      if (count < R) return sum_block<R - 1>(a, p, first, count, out);
    }
    sum_rows<R>(a, p, first, out);
  }

  template <typename T>
  void store(__m512 v, int64_t p, T* row) const {
    const int64_t col = p * kCols;
    const __mmask16 valid = width - col >= kCols ? 0xffff : static_cast<__mmask16>((1u << (width - col)) - 1);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(valid, bias + col));
    if constexpr (std::is_same_v<T, float>)
      _mm512_mask_storeu_ps(row + col, valid, v);
    else
      _mm256_mask_storeu_epi16(row + col, valid, pagedq::round_bf16(v));
  }
};

constexpr int64_t kRowsPerBlock = 8;  // 8 rows' int and float sums: 16 of the 32 vector registers
// Rows multiplied against each of a thread's panels before the next rows (a prompt's): their int8 inputs stay in
// L2 while the panels stream through.
constexpr int64_t kRowsPerPass = 64;

template <typename T>
void run_quant(const QuantGemm& g, const T* x, int64_t lda, int64_t rows, T* out) {
  Activations a(rows, g.k, g.layout.block);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) a.quantize(r, x + r * lda);
  });
  const int64_t panels = pagedq::round_up(g.width, kCols) / kCols;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    __m512 sums[kRowsPerBlock];
    for (int64_t pass = 0; pass < rows; pass += kRowsPerPass) {
      const int64_t pass_end = std::min(rows, pass + kRowsPerPass);
      for (int64_t p = begin; p < end; ++p)
        for (int64_t first = pass; first < pass_end; first += kRowsPerBlock) {
          const int64_t count = std::min(kRowsPerBlock, pass_end - first);
          g.sum_block(a, p, first, count, sums);
          for (int64_t r = 0; r < count; ++r) g.store(sums[r], p, out + (first + r) * g.width);
        }
    }
  });
}
#endif

}  // namespace

namespace pagedq {

std::string quant_linear_path() {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return "avx512_vnni";
#else
  return "";
#endif
}

void quant_linear_out(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
                      at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear: x is float32 or bfloat16 [M, K] rows with a contiguous last dimension");
  const int64_t rows = x.size(0), k = x.size(1), panels = round_up(n, kCols) / kCols;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.size(0) == panels &&
                  packed.is_contiguous(),
              "quant_linear: the weight is [ceil(N / 16), bytes a panel] uint8 (kernels/quant_layout.py)");
  const Layout layout = layout_of(packed.size(1), k);
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous()),
              "quant_linear: a float32 bias of N values");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.dim() == 2 && out.size(0) == rows &&
                  out.size(1) == n,
              "quant_linear: out is a contiguous [M, N] tensor in x's dtype");
  TORCH_CHECK(!quant_linear_path().empty(), "quant_linear: not built on this CPU (it needs AVX-512 VNNI)");
  if (rows == 0) return;
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  const QuantGemm g{layout, k, n, packed.data_ptr<uint8_t>(), bias ? bias->data_ptr<float>() : nullptr};
  if (x.scalar_type() == at::kFloat)
    run_quant(g, x.data_ptr<float>(), x.stride(0), rows, out.data_ptr<float>());
  else
    run_quant(g, x.data_ptr<c10::BFloat16>(), x.stride(0), rows, out.data_ptr<c10::BFloat16>());
#else
  (void)layout;
#endif
}

}  // namespace pagedq
