// bfloat16 linear layers on AMX tiles, with their weights packed once at load into the tiles' own layout, and
// SiLU-and-multiply fused into the gate-and-up projection. A decode step's few rows use each weight tile a handful
// of times, so the weights streaming from memory set the pace: the next panel of weights is prefetched while the
// current one is multiplied (without that, this loop measured no faster than oneDNN's prepacked linear, with it
// faster). The gated layer's output is its activation, so the [rows, 2 * inter] projection is never written out.
// Built with the other CPU kernels (kernels/cpu_ops.py); the ops are torch.ops.pagedq.tile_linear*.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <optional>

namespace {

// Weights are packed in panels of 32 output columns: for each 32 of the input (a k step), two B tiles of 16
// columns, row r of a tile holding inputs 2r and 2r + 1 of each column, interleaved (the tiles' pair layout).
constexpr int64_t kPanel = 32, kStep = 32, kTileElems = 16 * 32, kLine = 64;
// Rows multiplied against one panel before the next: they stay in L2 while the panels stream through L1.
constexpr int64_t kRowsPerPass = 256;

// The weight row feeding column c (0-31) of panel p: plain, columns in order; gated (gate rows [0, inter), up rows
// [inter, 2 inter)), a panel's first 16 columns are 16 gate rows and its last 16 the matching up rows.
int64_t source_row(int64_t panel, int64_t c, int64_t gate_rows) {
  if (gate_rows == 0) return panel * kPanel + c;
  return (c < 16 ? 0 : gate_rows) + panel * 16 + c % 16;
}

// w [N, K] -> the packed panels, as one flat tensor; columns past N (the last panel's tail) are zeros.
at::Tensor tile_linear_pack(const at::Tensor& w, int64_t gate_rows) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "tile_linear_pack: a bfloat16 [N, K] weight");
  const int64_t n = w.size(0), k = w.size(1), steps = k / kStep;
  TORCH_CHECK(k % kStep == 0, "tile_linear_pack: K a multiple of 32");
  TORCH_CHECK(gate_rows == 0 || (2 * gate_rows == n && gate_rows % 16 == 0),
              "tile_linear_pack: gated weights are [2 * inter, K], inter a multiple of 16");
  const int64_t panels = gate_rows ? gate_rows / 16 : pagedq::round_up(n, kPanel) / kPanel;
  const at::Tensor src = w.contiguous();
  at::Tensor out = at::zeros({panels * steps * 2 * kTileElems}, w.options());
  const auto* s = src.data_ptr<at::BFloat16>();
  auto* d = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t row = source_row(p, c, gate_rows);
        if (row >= n) continue;
        at::BFloat16* tile = d + p * steps * 2 * kTileElems + (c / 16) * kTileElems + (c % 16) * 2;
        for (int64_t i = 0; i < k; ++i)
          tile[(i / kStep) * 2 * kTileElems + (i % kStep) / 2 * 32 + i % 2] = s[row * k + i];
      }
  });
  return out;
}

#if defined(PAGEDQ_AMX)
// What one call multiplies: x rows [M, K] (row stride lda) by the packed panels, into out [M, width].
struct Gemm {
  const at::BFloat16* x;
  int64_t lda, rows, k;
  const at::BFloat16* panels;
  const float* bias;  // per output column, or null
  int64_t width;      // out's columns: N, or inter when gated
  bool gated;
  at::BFloat16* out;  // rows `width` apart
  const at::BFloat16* tail;  // the last rows % 16 rows, padded with zero rows to a whole tile

  int64_t steps() const { return k / kStep; }
  int64_t panel_elems() const { return steps() * 2 * kTileElems; }
  int64_t whole_rows() const { return rows / 16 * 16; }

  // 16 rows from `row` on, as an A tile's source.
  const at::BFloat16* row_tile(int64_t row) const { return row < whole_rows() ? x + row * lda : tail; }
  int64_t row_stride(int64_t row) const { return row < whole_rows() ? lda : k; }

  // Rows [first, first + count), count <= 32, of panel p into C tiles 0-1 (first 16 rows) and 2-3 (next 16).
  // While it runs, `ahead` (the next panel) is prefetched a share `lines` at a time from line `*next` on.
  void multiply(int64_t p, int64_t first, int64_t count, const char* ahead, int64_t lines, int64_t* next) const {
    const at::BFloat16* b = panels + p * panel_elems();
    const at::BFloat16 *a0 = row_tile(first), *a1 = row_tile(first + 16);
    const int64_t s0 = row_stride(first) * 2, s1 = row_stride(first + 16) * 2, total = panel_elems() * 2 / kLine;
    const bool two = count > 16;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t step = 0; step < steps(); ++step) {
      for (int64_t end = std::min(total, *next + lines); ahead && *next < end; ++*next)
        _mm_prefetch(ahead + *next * kLine, _MM_HINT_T0);
      _tile_loadd(4, a0 + step * kStep, s0);
      _tile_loadd(6, b + step * 2 * kTileElems, 64);
      _tile_loadd(7, b + step * 2 * kTileElems + kTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, a1 + step * kStep, s1);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
  }

  // The C tiles of rows [first, first + count) of panel p, written to out as bfloat16.
  void store(int64_t p, int64_t first, int64_t count) const {
    alignas(64) float sums[32][32];
    _tile_stored(0, &sums[0][0], sizeof sums[0]);
    _tile_stored(1, &sums[0][16], sizeof sums[0]);
    if (count > 16) {
      _tile_stored(2, &sums[16][0], sizeof sums[0]);
      _tile_stored(3, &sums[16][16], sizeof sums[0]);
    }
    for (int64_t r = 0; r < count; ++r) {
      at::BFloat16* o = out + (first + r) * width;
      if (gated) {  // the projection rounded to bfloat16, as F.linear's output would be, then activated
        const __m512 gate = pagedq::widen_bf16(pagedq::round_bf16(_mm512_loadu_ps(sums[r])));
        const __m512 up = pagedq::widen_bf16(pagedq::round_bf16(_mm512_loadu_ps(sums[r] + 16)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + p * 16), pagedq::silu_mul16(gate, up));
        continue;
      }
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t col = p * kPanel + half * 16;
        if (col >= width) break;
        const __mmask16 valid = width - col >= 16 ? 0xffff : static_cast<__mmask16>((1u << (width - col)) - 1);
        __m512 v = _mm512_loadu_ps(sums[r] + half * 16);
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(valid, bias + col));
        _mm256_mask_storeu_epi16(o + col, valid, pagedq::round_bf16(v));
      }
    }
  }

  // Panels [begin, end) for every row: rows a pass at a time, each pass over the panels in turn.
  void run(int64_t begin, int64_t end) const {
    const pagedq::Tiles tiles;
    const int64_t total_lines = panel_elems() * 2 / kLine;
    for (int64_t pass = 0; pass < rows; pass += kRowsPerPass) {
      const int64_t pass_rows = std::min(kRowsPerPass, rows - pass);
      const int64_t blocks = (pass_rows + 31) / 32;
      const int64_t lines = (total_lines + blocks * steps() - 1) / (blocks * steps());  // per k step
      for (int64_t p = begin; p < end; ++p) {
        const char* ahead = p + 1 < end ? reinterpret_cast<const char*>(panels + (p + 1) * panel_elems()) : nullptr;
        int64_t next = 0;
        for (int64_t first = pass; first < pass + pass_rows; first += 32) {
          const int64_t count = std::min<int64_t>(32, pass + pass_rows - first);
          multiply(p, first, count, ahead, lines, &next);
          store(p, first, count);
        }
      }
    }
  }
};

bool tile_linear_ready() { return pagedq::amx_ready(); }

// out = x @ w.T (+ bias), or silu(gate) * up when gated, for x [M, K] rows with a contiguous last dimension.
at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t n, bool gated) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "tile_linear: x is bfloat16 [M, K] rows with a contiguous last dimension");
  const int64_t rows = x.size(0), k = x.size(1), width = gated ? n / 2 : n;
  const int64_t panels = gated ? width / 16 : pagedq::round_up(n, kPanel) / kPanel;
  TORCH_CHECK(k % kStep == 0 && packed.numel() == panels * k * kPanel && (!gated || width % 16 == 0),
              "tile_linear: the weight was packed for another shape");
  TORCH_CHECK(!bias || (!gated && bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous()),
              "tile_linear: a float32 bias of N values, not gated");
  TORCH_CHECK(tile_linear_ready(), "tile_linear: this CPU (or process) has no AMX tiles");
  at::Tensor out = at::empty({rows, width}, x.options());
  if (rows == 0) return out;
  // The rows past the last whole tile, copied into zero rows (no torch ops: a decode step calls this 120 times).
  const int64_t whole = rows / 16 * 16;
  thread_local std::vector<at::BFloat16> tail;
  tail.assign(whole < rows ? 16 * k : 0, at::BFloat16(0.f));
  for (int64_t r = whole; r < rows; ++r)
    std::memcpy(tail.data() + (r - whole) * k, x.data_ptr<at::BFloat16>() + r * x.stride(0), k * sizeof(at::BFloat16));
  const Gemm gemm{x.data_ptr<at::BFloat16>(), x.stride(0), rows, k, packed.data_ptr<at::BFloat16>(),
                  bias ? bias->data_ptr<float>() : nullptr, width, gated, out.data_ptr<at::BFloat16>(), tail.data()};
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) { gemm.run(begin, end); });
  return out;
}
#else
bool tile_linear_ready() { return false; }

at::Tensor tile_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t, bool) {
  TORCH_CHECK(false, "tile_linear: not built without AMX");
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedq, m) {
  m.def("tile_linear_ready() -> bool", &tile_linear_ready);
  m.def("tile_linear_pack(Tensor w, int gate_rows) -> Tensor");
  m.def("tile_linear(Tensor x, Tensor packed, Tensor? bias, int n, bool gated) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedq, CPU, m) {
  m.impl("tile_linear_pack", &tile_linear_pack);
  m.impl("tile_linear", &tile_linear);
}
