// Linear layers of pagedq's own on AVX-512 CPUs, with their weights packed once at load into panels of 32 output
// columns, and (bfloat16) SiLU-and-multiply fused into the gate-and-up projection, so that the [rows, 2 * inter]
// projection is never written out. Three ways to multiply a panel, one layout per dtype:
// - bfloat16 on AMX tiles, where the CPU has them: the panel's B tiles as they sit in memory, 32 rows at a time.
//   A decode step's few rows use each weight tile a handful of times, so the weights streaming from memory set the
//   pace: the next panel is prefetched while one is multiplied (without that, this loop measured no faster than
//   oneDNN's prepacked linear; with it, faster).
// - bfloat16 with AVX-512 BF16 dot products (vdpbf16ps), on the same layout: a B tile's row is one register of 16
//   columns by a pair of inputs, which a broadcast pair of a row's inputs multiplies.
// - float32 with AVX-512 multiply-adds: a panel's 32 columns of each input in two registers.
// Every path sums a panel's columns for a block of rows in float32 registers, in input order, then writes them out
// (a float32 bias added first; bfloat16 rounded as c10 rounds). Built with the other CPU kernels (kernels/build.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_library.h"
#include "cpu_math.h"

#include <optional>

namespace {

// bfloat16 panels: for each 32 of the input (a k step), 16 rows of 128 bytes, row r holding inputs 2r and 2r + 1 of
// the panel's first 16 columns, then of its next 16, interleaved in pairs. AMX reads the two halves as B tiles (rows
// 128 bytes apart), AVX-512 a row as two registers; either way the panel streams in order, which measured 1.3-1.6x
// faster at 1-16 rows than two tiles one after the other. float32 panels: each input's 32 columns in turn.
constexpr int64_t kPanel = 32, kStep = 32, kTileElems = 16 * 32, kPairRow = 64, kLine = 64;
// Rows multiplied against one panel before the next: they stay in L2 while the panels stream through L1.
constexpr int64_t kRowsPerPass = 256;

// The weight row feeding column c (0-31) of panel p: plain, columns in order; gated (gate rows [0, inter), up rows
// [inter, 2 inter)), a panel's first 16 columns are 16 gate rows and its last 16 the matching up rows.
int64_t source_row(int64_t panel, int64_t c, int64_t gate_rows) {
  if (gate_rows == 0) return panel * kPanel + c;
  return (c < 16 ? 0 : gate_rows) + panel * 16 + c % 16;
}

// Where input i of column c (0-31) sits within its panel.
int64_t packed_index(bool pairs, int64_t i, int64_t c) {
  if (!pairs) return i * kPanel + c;
  return (i / kStep) * 2 * kTileElems + (i % kStep) / 2 * kPairRow + (c / 16) * 32 + (c % 16) * 2 + i % 2;
}

int64_t panel_count(int64_t n, int64_t gate_rows) {
  return gate_rows ? gate_rows / 16 : pagedq::round_up(n, kPanel) / kPanel;
}

}  // namespace

namespace pagedq {

// w [N, K] -> the packed panels, as one flat tensor; columns past N (the last panel's tail) are zeros.
at::Tensor panel_pack(const at::Tensor& w, int64_t gate_rows) {
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(w.dim() == 2 && (bf16 || w.scalar_type() == at::kFloat), "panel_pack: a bfloat16 or float32 [N, K] weight");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % kStep == 0, "panel_pack: K a multiple of 32");
  TORCH_CHECK(gate_rows == 0 || (2 * gate_rows == n && gate_rows % 16 == 0),
              "panel_pack: gated weights are [2 * inter, K], inter a multiple of 16");
  const int64_t panels = panel_count(n, gate_rows);
  const at::Tensor src = w.contiguous();
  at::Tensor out = at::zeros({panels * k * kPanel}, w.options());
  const auto element = w.element_size();
  const auto* s = static_cast<const char*>(src.data_ptr());
  auto* d = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t row = source_row(p, c, gate_rows);
        if (row >= n) continue;
        char* panel = d + p * k * kPanel * element;
        for (int64_t i = 0; i < k; ++i)
          std::memcpy(panel + packed_index(bf16, i, c) * element, s + (row * k + i) * element, element);
      }
  });
  return out;
}

}  // namespace pagedq

namespace {

// Which multiply a dtype's panels get on this CPU: "amx", "avx512_bf16", "avx512" (float32) or "" (none built).
std::string path_for(at::ScalarType dtype) {
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return "avx512";
  if (dtype == at::kBFloat16) {
#if defined(PAGEDQ_AMX)
    if (pagedq::amx_ready()) return "amx";
#endif
#if defined(__AVX512BF16__)
    return "avx512_bf16";
#endif
  }
#endif
  (void)dtype;
  return "";
}

#if defined(__AVX512F__)
// What one call multiplies: x rows [M, K] (row stride lda) by the packed panels, into out [M, width].
template <typename T>
struct Gemm {
  const T* x;
  int64_t lda, rows, k;
  const T* panels;
  const float* bias;  // per output column, or null
  int64_t width;      // out's columns: N, or inter when gated
  bool gated;
  T* out;  // rows `width` apart

  int64_t panel_elems() const { return k * kPanel; }
  const T* panel(int64_t p) const { return panels + p * panel_elems(); }

  // Sums of rows [first, first + count) of panel p, as sums[row][column], written out: bias, rounding, activation.
  void store(const float (*sums)[kPanel], int64_t p, int64_t first, int64_t count) const {
    for (int64_t r = 0; r < count; ++r) {
      T* o = out + (first + r) * width;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (gated) {  // the projection rounded to bfloat16, as F.linear's output would be, then activated
          const __m512 gate = pagedq::widen_bf16(pagedq::round_bf16(_mm512_loadu_ps(sums[r])));
          const __m512 up = pagedq::widen_bf16(pagedq::round_bf16(_mm512_loadu_ps(sums[r] + 16)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + p * 16), pagedq::silu_mul16(gate, up));
          continue;
        }
      }
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t col = p * kPanel + half * 16;
        if (col >= width) break;
        const __mmask16 valid = width - col >= 16 ? 0xffff : static_cast<__mmask16>((1u << (width - col)) - 1);
        __m512 v = _mm512_loadu_ps(sums[r] + half * 16);
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(valid, bias + col));
        if constexpr (std::is_same_v<T, float>)
          _mm512_mask_storeu_ps(o + col, valid, v);
        else
          _mm256_mask_storeu_epi16(o + col, valid, pagedq::round_bf16(v));
      }
    }
  }

  // Panels [begin, end) for every row: rows a pass at a time, each pass over the panels in turn, `Block` rows of a
  // pass at a time (sum(p, first, count, sums)).
  template <int64_t Block, typename Sum>
  void run_blocks(int64_t begin, int64_t end, const Sum& sum) const {
    alignas(64) float sums[Block][kPanel];
    for (int64_t pass = 0; pass < rows; pass += kRowsPerPass) {
      const int64_t pass_end = std::min(rows, pass + kRowsPerPass);
      // Blocks of about equal size: 16 rows as 8 and 8, not 12 and 4 (a block costs the same weight loads).
      const int64_t blocks = (pass_end - pass + Block - 1) / Block;
      const int64_t size = (pass_end - pass + blocks - 1) / blocks;
      for (int64_t p = begin; p < end; ++p)
        for (int64_t first = pass; first < pass_end; first += size) {
          const int64_t count = std::min(size, pass_end - first);
          sum(p, first, count, sums);
          store(sums, p, first, count);
        }
    }
  }
};

// Rows' sums over a panel in registers: R rows by the panel's two 16-column halves. Pairs: bfloat16 pair layout
// (vdpbf16ps), else float32 (multiply-adds).
template <int R, typename T>
void sum_rows(const Gemm<T>& g, int64_t p, int64_t first, float (*sums)[kPanel]) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const T* b = g.panel(p);
  if constexpr (std::is_same_v<T, float>) {
    const float* x[R];
    for (int r = 0; r < R; ++r) x[r] = g.x + (first + r) * g.lda;
    for (int64_t i = 0; i < g.k; ++i, b += kPanel) {
      const __m512 w0 = _mm512_loadu_ps(b), w1 = _mm512_loadu_ps(b + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(x[r][i]);
        acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
      }
    }
  } else {
#if defined(__AVX512BF16__)
    const int32_t* x[R];  // a row's inputs as pairs
    for (int r = 0; r < R; ++r) x[r] = reinterpret_cast<const int32_t*>(g.x + (first + r) * g.lda);
    for (int64_t step = 0; step < g.k / kStep; ++step, b += 2 * kTileElems)
      for (int64_t pair = 0; pair < kStep / 2; ++pair) {
        const auto w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + pair * kPairRow));
        const auto w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + pair * kPairRow + 32));
        for (int r = 0; r < R; ++r) {
          const auto a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(x[r][step * kStep / 2 + pair]));
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
        }
      }
#endif
  }
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(sums[r], acc[r][0]);
    _mm512_store_ps(sums[r] + 16, acc[r][1]);
  }
}

// Rows per block in registers: 12 rows by 2 halves take 24 of the 32 vector registers.
constexpr int64_t kBlockRows = 12;

template <typename T, int R = kBlockRows>
void sum_block(const Gemm<T>& g, int64_t p, int64_t first, int64_t count, float (*sums)[kPanel]) {
  if constexpr (R > 1) {
    if (count < R) return sum_block<T, R - 1>(g, p, first, count, sums);
  }
  sum_rows<R>(g, p, first, sums);
}

#if defined(PAGEDQ_AMX)
// The AMX multiply of bfloat16 panels, 32 rows (two A tiles) at a time against a panel's two B tile columns.
struct TileGemm {
  const Gemm<c10::BFloat16>& g;
  const c10::BFloat16* tail;  // the last rows % 16 rows, padded with zero rows to a whole tile

  int64_t steps() const { return g.k / kStep; }
  int64_t whole_rows() const { return g.rows / 16 * 16; }
  const c10::BFloat16* row_tile(int64_t row) const { return row < whole_rows() ? g.x + row * g.lda : tail; }
  int64_t row_stride(int64_t row) const { return row < whole_rows() ? g.lda : g.k; }

  // Rows [first, first + count), count <= 32, of panel p into C tiles 0-1 (first 16 rows) and 2-3 (next 16).
  // While it runs, `ahead` (the next panel) is prefetched a share `lines` at a time from line `*next` on.
  void multiply(int64_t p, int64_t first, int64_t count, const char* ahead, int64_t lines, int64_t* next) const {
    const c10::BFloat16* b = g.panel(p);
    const c10::BFloat16 *a0 = row_tile(first), *a1 = row_tile(first + 16);
    const int64_t s0 = row_stride(first) * 2, s1 = row_stride(first + 16) * 2, total = g.panel_elems() * 2 / kLine;
    const bool two = count > 16;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t step = 0; step < steps(); ++step) {
      for (int64_t end = std::min(total, *next + lines); ahead && *next < end; ++*next)
        _mm_prefetch(ahead + *next * kLine, _MM_HINT_T0);
      _tile_loadd(4, a0 + step * kStep, s0);
      _tile_loadd(6, b + step * 2 * kTileElems, kPairRow * 2);
      _tile_loadd(7, b + step * 2 * kTileElems + 32, kPairRow * 2);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, a1 + step * kStep, s1);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
  }

  void run(int64_t begin, int64_t end) const {
    const pagedq::Tiles tiles;
    const int64_t total_lines = g.panel_elems() * 2 / kLine;
    alignas(64) float sums[32][kPanel];
    for (int64_t pass = 0; pass < g.rows; pass += kRowsPerPass) {
      const int64_t pass_rows = std::min(kRowsPerPass, g.rows - pass);
      const int64_t blocks = (pass_rows + 31) / 32;
      const int64_t lines = (total_lines + blocks * steps() - 1) / (blocks * steps());  // per k step
      for (int64_t p = begin; p < end; ++p) {
        const char* ahead = p + 1 < end ? reinterpret_cast<const char*>(g.panel(p + 1)) : nullptr;
        int64_t next = 0;
        for (int64_t first = pass; first < pass + pass_rows; first += 32) {
          const int64_t count = std::min<int64_t>(32, pass + pass_rows - first);
          multiply(p, first, count, ahead, lines, &next);
          _tile_stored(0, &sums[0][0], sizeof sums[0]);
          _tile_stored(1, &sums[0][16], sizeof sums[0]);
          if (count > 16) {
            _tile_stored(2, &sums[16][0], sizeof sums[0]);
            _tile_stored(3, &sums[16][16], sizeof sums[0]);
          }
          g.store(sums, p, first, count);
        }
      }
    }
  }
};

void run_tiles(const Gemm<c10::BFloat16>& g, int64_t panels) {
  // The rows past the last whole tile, copied into zero rows (no torch ops: a decode step calls this 120 times).
  const int64_t whole = g.rows / 16 * 16;
  thread_local std::vector<c10::BFloat16> tail;
  tail.assign(whole < g.rows ? 16 * g.k : 0, c10::BFloat16(0.f));
  for (int64_t r = whole; r < g.rows; ++r)
    std::memcpy(tail.data() + (r - whole) * g.k, g.x + r * g.lda, g.k * sizeof(c10::BFloat16));
  const TileGemm tiles{g, tail.data()};
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) { tiles.run(begin, end); });
}
#endif

template <typename T>
void run_gemm(const Gemm<T>& g, int64_t panels) {
#if defined(PAGEDQ_AMX)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (pagedq::amx_ready()) return run_tiles(g, panels);
  }
#endif
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    g.template run_blocks<kBlockRows>(begin, end, [&](int64_t p, int64_t first, int64_t count, float (*sums)[kPanel]) {
      sum_block<T>(g, p, first, count, sums);
    });
  });
}
#endif

}  // namespace

namespace pagedq {

// out = x @ w.T (+ bias), or silu(gate) * up when gated, for x [M, K] rows with a contiguous last dimension.
void panel_linear_out(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
                      bool gated, at::Tensor out) {
  if (packed.scalar_type() == at::kByte)  // weights kept quantized (kernels/cpu_quant.cpp)
    return quant_linear_out(x, packed, bias, n, gated, out);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == packed.scalar_type(),
              "panel_linear: x is [M, K] rows with a contiguous last dimension, in the weight's dtype");
  const int64_t rows = x.size(0), k = x.size(1), width = gated ? n / 2 : n;
  const int64_t panels = panel_count(n, gated ? width : 0);
  TORCH_CHECK(k % kStep == 0 && packed.numel() == panels * k * kPanel && (!gated || width % 16 == 0),
              "panel_linear: the weight was packed for another shape");
  TORCH_CHECK(!bias || (!gated && bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous()),
              "panel_linear: a float32 bias of N values, not gated");
  TORCH_CHECK(!gated || x.scalar_type() == at::kBFloat16, "panel_linear: gated is for bfloat16 weights");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.dim() == 2 && out.size(0) == rows &&
                  out.size(1) == width,
              "panel_linear: out is a contiguous [M, ", width, "] tensor in x's dtype");
  TORCH_CHECK(!path_for(x.scalar_type()).empty(), "panel_linear: not built for ", x.scalar_type(), " on this CPU");
  if (rows == 0) return;
#if defined(__AVX512F__)
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    run_gemm(Gemm<float>{x.data_ptr<float>(), x.stride(0), rows, k, packed.data_ptr<float>(), b, width, gated,
                         out.data_ptr<float>()},
             panels);
  } else {
    using BF16 = c10::BFloat16;
    run_gemm(Gemm<BF16>{x.data_ptr<BF16>(), x.stride(0), rows, k, packed.data_ptr<BF16>(), b, width, gated,
                        out.data_ptr<BF16>()},
             panels);
  }
#endif
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
                        bool gated) {
  at::Tensor out = at::empty({x.size(0), gated ? n / 2 : n}, x.options());
  panel_linear_out(x, packed, bias, n, gated, out);
  return out;
}

std::string panel_linear_path(const std::string& dtype) {
  return path_for(dtype == "float32" ? at::kFloat : dtype == "bfloat16" ? at::kBFloat16 : at::kHalf);
}

}  // namespace pagedq

TORCH_LIBRARY_IMPL(pagedq, CPU, m) {
  m.impl("panel_pack", &pagedq::panel_pack);
  m.impl("panel_linear", &pagedq::panel_linear);
  m.impl("panel_linear_out", &pagedq::panel_linear_out);
}
