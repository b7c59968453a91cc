// Linear layers on weights kept quantized (GGUF Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks, int8 per channel), multiplied
// with integer dot products: AVX-512 VNNI (vpdpbusd, 16 columns a register), else AVX2 (8 columns a register:
// AVX-VNNI's vpdpbusd where the CPU has it, else vpmaddubsw + vpmaddwd). A decode step reads every weight once, so
// its pace is bytes over memory bandwidth: 4-bit weights are read as 0.5625-0.625 bytes (0.75 with float32
// scales), 8-bit as 1.0625-1.125 (1.25; 1.5 for Q6_K), against bfloat16's 2. With many rows (batch 16, prompts) it
// is the multiply's pace instead.
//
// kernels/quant_layout.py repacks a format's blocks, losslessly, into one layout of this file: each weight is
// scale * u + min, u an unsigned 4- or 8-bit integer, with a float32 scale and min per output column and block of B
// inputs (B = 32, or 16 for Q6_K's sub-blocks). Output columns go in panels of 16; a panel holds, block after block,
// the block's u as B/4 registers of 16 columns by 4 inputs (4-bit: two such registers a register, the first in the
// low nibbles), then its 16 scales, then its 16 mins. One vpdpbusd multiplies a register by 4 inputs of a row.
// Scales and mins are float16 where every one of a layer's is a float16 exactly (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 store
// them so), blocks of 32 only: a Q4_1 block then reads 0.625 bytes a weight, as the file holds it, not 0.75. A
// symmetric layer (Q8_0, Q4_0, int8: every min is -2^(bits-1) times its scale, u a signed integer stored offset)
// stores no mins: the offset goes into the integer sums instead, sum((u - 2^(bits-1)) * qx).
//
// Activations are quantized per row and block to int8 (x ~ dx * qx, dx = max|x| / 127), as llama.cpp does, so a
// block's sum is scale * dx * sum(u * qx) + min * dx * sum(qx): integer dot products, then two multiply-adds. The
// rounding of x to int8 is the only error against a float matmul of the same weights.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_library.h"
#include "cpu_math.h"

#include <iterator>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDQ_QUANT_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGEDQ_QUANT_AVX2 1
#endif

namespace {

constexpr int64_t kCols = 16;  // output columns a panel

// The layouts, told apart by a panel's bytes per input (K): 4-bit and 8-bit u in blocks of 32 with float32 or
// float16 scales and mins (12, 10, 20 and 18 bytes an input) or float16 scales alone (9 and 17), 8-bit in blocks of
// 16 with float32 ones (24).
struct Layout {
  int64_t bits, block;
  bool half, symmetric;
  constexpr int64_t quant_bytes() const { return block * kCols * bits / 8; }
  constexpr int64_t scales_bytes() const { return kCols * (half ? 2 : 4); }  // a block's scales, and its mins
  constexpr int64_t block_bytes() const { return quant_bytes() + (symmetric ? 1 : 2) * scales_bytes(); }
  constexpr int64_t panel_bytes(int64_t k) const { return k / block * block_bytes(); }
  constexpr int32_t offset() const { return symmetric ? -(1 << (bits - 1)) : 0; }  // the min over the scale
  constexpr bool operator==(const Layout& o) const {
    return bits == o.bits && block == o.block && half == o.half && symmetric == o.symmetric;
  }
  constexpr bool operator!=(const Layout& o) const { return !(*this == o); }
};

constexpr Layout kLayouts[] = {{4, 32, false, false}, {4, 32, true, false}, {4, 32, true, true},
                               {8, 32, false, false}, {8, 32, true, false}, {8, 32, true, true},
                               {8, 16, false, false}};

Layout layout_of(int64_t panel_bytes, int64_t k) {
  for (const Layout& l : kLayouts)
    if (k % l.block == 0 && l.panel_bytes(k) == panel_bytes) return l;
  TORCH_CHECK(false, "quant_linear: ", panel_bytes, " bytes a panel fit no layout for K = ", k);
}

#if defined(PAGEDQ_QUANT_AVX512) || defined(PAGEDQ_QUANT_AVX2)
constexpr int64_t kGroup = 8;  // rows quantized together: the AVX-512 kernel's 8 int and 8 float accumulators
// Row groups multiplied against each of a thread's panels before the next ones (a prompt's): their int8 inputs stay
// in L2 while the panels stream through.
constexpr int64_t kGroupsPerPass = 8;

// The rows' activations as int8, in groups of `group` rows (kGroup, or all of fewer): per group and block, the
// block's qx as words of 4 inputs (quad after quad, the group's rows side by side), then the rows' dx, then their
// dx * sum(qx) (float32), or for a symmetric layout offset * sum(qx) (int32: where the integer sums start). A
// kernel reads a row's word at a fixed offset from the block's start, so the broadcast folds into the dot product's
// operand; a decode row alone has no gaps (they would take cache from the streaming weights).
// Words of a row past the last in its group are never read, so they are left as they are: the buffer is the calling
// thread's, kept from call to call (a new one a call was pages zeroed by the kernel, ~5% of a batch-16 step).
struct Activations {
  int64_t group, blocks, quads, record;
  int32_t offset;
  int32_t* words;

  Activations(int64_t rows, int64_t k, const Layout& layout)
      : group(std::min(rows, kGroup)), blocks(k / layout.block), quads(layout.block / 4),
        record((quads + 2) * group), offset(layout.offset()) {
    thread_local std::vector<int32_t> buffer;
    const auto size = static_cast<size_t>((rows + group - 1) / group * blocks * record);
    if (buffer.size() < size) buffer.resize(size);
    words = buffer.data();
  }

  const int32_t* at(int64_t g) const { return words + g * blocks * record; }

  // Block b of a row, quantized into q (its int8 values) -> dx and sum(qx); vectorized below per ISA.
  template <typename T>
  static void quantize_block(const T* x, int64_t n, int8_t* q, float& dx, int32_t& sum);

  template <typename T>
  void quantize(int64_t row, const T* x) {
    int32_t* at = words + row / group * blocks * record + row % group;
    const int64_t n = quads * 4;
    for (int64_t b = 0; b < blocks; ++b, at += record) {
      int8_t q[32];
      float dx;
      int32_t sum;
      quantize_block(x + b * n, n, q, dx, sum);
      for (int64_t j = 0; j < quads; ++j) std::memcpy(at + j * group, q + 4 * j, 4);
      float* scales = reinterpret_cast<float*>(at + quads * group);
      scales[0] = dx;
      if (offset)
        at[(quads + 1) * group] = offset * sum;
      else
        scales[group] = dx * static_cast<float>(sum);
    }
  }
};

// The reciprocal the rows are quantized with: 127 / max|x|, 0 for a block of zeros.
inline float inverse_step(float amax) { return amax > 0.f ? 127.f / amax : 0.f; }

// Calls f(p, g) for each panel p and row group g, the panels spread over threads.
template <typename F>
void for_panels(int64_t width, int64_t rows, int64_t group, F f) {
  const int64_t panels = pagedq::round_up(width, kCols) / kCols, groups = (rows + group - 1) / group;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pass = 0; pass < groups; pass += kGroupsPerPass)
      for (int64_t p = begin; p < end; ++p)
        for (int64_t g = pass; g < std::min(groups, pass + kGroupsPerPass); ++g) f(p, g);
  });
}
#endif

#if defined(PAGEDQ_QUANT_AVX512)
template <typename T>
void Activations::quantize_block(const T* x, int64_t n, int8_t* q, float& dx, int32_t& sum) {
  __m512 v[2];
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < n / 16; ++i) {
    v[i] = pagedq::load16(x + i * 16);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
  }
  const float m = _mm512_reduce_max_ps(amax), inv = inverse_step(m);
  __m512i total = _mm512_setzero_si512();
  for (int64_t i = 0; i < n / 16; ++i) {
    // rounded to nearest even (the MXCSR default), as std::nearbyint and torch.round
    const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(inv)));
    total = _mm512_add_epi32(total, qi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * 16), _mm512_cvtepi32_epi8(qi));
  }
  dx = m / 127.f;
  sum = _mm512_reduce_add_epi32(total);
}

// dot + the 4-input sums of u (16 columns) by a row's 4 inputs, the word at x broadcast in the instruction itself:
// compilers load it into a register of its own first, an instruction more per dot product.
inline __m512i dot4(__m512i dot, __m512i u, const int32_t* x) {
  asm("vpdpbusd %[x]%{1to16%}, %[u], %[dot]" : [dot] "+v"(dot) : [u] "v"(u), [x] "m"(*x));
  return dot;
}

// One layout's multiply, 16 columns a register: the compiler knows the block, so a block's loops unroll.
template <int Bits, int Block, bool Half, bool Symmetric>
struct Avx512 {
  static constexpr Layout kLayout{Bits, Block, Half, Symmetric};
  static constexpr int kQuads = Block / 4;
  static constexpr int64_t kQuantBytes = kLayout.quant_bytes(), kBlockBytes = kLayout.block_bytes();

  // A block's 16 scales, or its 16 mins, as float32.
  static __m512 load_scales(const uint8_t* p) {
    if constexpr (Half)
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    else
      return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  }

  // Sums of a group's first R rows (S rows a group) over a panel (`blocks` blocks from q), as 16 columns each.
  template <int R, int S>
  static void sum_rows(const uint8_t* q, int64_t blocks, const int32_t* a, __m512* out) {
    constexpr int64_t kRecord = (kQuads + 2) * S;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b, q += kBlockBytes, a += kRecord) {
      // A row alone (decode) puts its odd quads on a second chain: the dot products' latency must not pace the
      // weights' stream.
      constexpr bool kSplit = R == 1;
      __m512i dot[R], odd[R];
      for (int r = 0; r < R; ++r) {
        odd[r] = _mm512_setzero_si512();
        // symmetric: the sums start at offset * sum(qx), so they end at sum((u + offset) * qx)
        dot[r] = Symmetric ? _mm512_set1_epi32(a[(kQuads + 1) * S + r]) : odd[r];
      }
      if constexpr (Bits == 4) {
        const __m512i low = _mm512_set1_epi8(0x0f);
        for (int i = 0; i < kQuads / 2; ++i) {
          const __m512i both = _mm512_loadu_si512(q + i * 64);
          const __m512i w0 = _mm512_and_si512(both, low), w1 = _mm512_and_si512(_mm512_srli_epi16(both, 4), low);
          for (int r = 0; r < R; ++r) {
            dot[r] = dot4(dot[r], w0, a + 2 * i * S + r);
            __m512i& d = kSplit ? odd[r] : dot[r];
            d = dot4(d, w1, a + (2 * i + 1) * S + r);
          }
        }
      } else {
        for (int j = 0; j < kQuads; ++j) {
          const __m512i w = _mm512_loadu_si512(q + j * 64);
          for (int r = 0; r < R; ++r) {
            __m512i& d = kSplit && j % 2 ? odd[r] : dot[r];
            d = dot4(d, w, a + j * S + r);
          }
        }
      }
      if constexpr (kSplit) dot[0] = _mm512_add_epi32(dot[0], odd[0]);
      const auto* dx = reinterpret_cast<const float*>(a + kQuads * S);
      const __m512 scale = load_scales(q + kQuantBytes);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(scale, _mm512_set1_ps(dx[r])), acc[r]);
      if constexpr (!Symmetric) {
        const __m512 min = load_scales(q + kQuantBytes + kLayout.scales_bytes());
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(dx[S + r]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r];
  }

  // The first `count` rows of a group of `group` rows: a full group's stride is kGroup, a smaller one's its rows.
  template <int R = kGroup>
  static void sum_group(const uint8_t* q, int64_t blocks, const int32_t* a, int64_t group, int64_t count,
                        __m512* out) {
    if constexpr (R > 1) {
      if (count < R) return sum_group<R - 1>(q, blocks, a, group, count, out);
    }
    if (group == kGroup)
      sum_rows<R, kGroup>(q, blocks, a, out);
    else
      sum_rows<R, R>(q, blocks, a, out);
  }

  template <typename T>
  static void run(const Activations& a, const uint8_t* panels, int64_t k, const float* bias, int64_t width,
                  int64_t rows, T* out) {
    const int64_t blocks = k / Block;
    for_panels(width, rows, a.group, [&](int64_t p, int64_t g) {
      __m512 sums[kGroup];
      const int64_t count = std::min(a.group, rows - g * a.group), col = p * kCols;
      sum_group(panels + p * blocks * kBlockBytes, blocks, a.at(g), a.group, count, sums);
      const __mmask16 valid = width - col >= kCols ? 0xffff : static_cast<__mmask16>((1u << (width - col)) - 1);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(valid, bias + col) : _mm512_setzero_ps();
      for (int64_t r = 0; r < count; ++r) {
        T* row = out + (g * a.group + r) * width + col;
        if constexpr (std::is_same_v<T, float>)
          _mm512_mask_storeu_ps(row, valid, _mm512_add_ps(sums[r], b));
        else
          _mm256_mask_storeu_epi16(row, valid, pagedq::round_bf16(_mm512_add_ps(sums[r], b)));
      }
    });
  }

  // silu(gate) * up of an MLP's gate-and-up projection whose panels alternate (2p: gate columns 16p to 16p + 15,
  // 2p + 1: the same up columns), width = N / 2 a multiple of 16, no bias: gate and up rounded to bfloat16 first, as
  // the projection's output is where they go apart (then silu_and_mul's roundings).
  static void run_gated(const Activations& a, const uint8_t* panels, int64_t k, int64_t width, int64_t rows,
                        c10::BFloat16* out) {
    const int64_t blocks = k / Block;
    const auto as_bf16 = [](__m512 v) { return pagedq::widen_bf16(pagedq::round_bf16(v)); };
    for_panels(width, rows, a.group, [&](int64_t p, int64_t g) {
      __m512 gate[kGroup], up[kGroup];
      const int64_t count = std::min(a.group, rows - g * a.group);
      sum_group(panels + 2 * p * blocks * kBlockBytes, blocks, a.at(g), a.group, count, gate);
      sum_group(panels + (2 * p + 1) * blocks * kBlockBytes, blocks, a.at(g), a.group, count, up);
      for (int64_t r = 0; r < count; ++r)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (g * a.group + r) * width + p * kCols),
                            pagedq::silu_mul16(as_bf16(gate[r]), as_bf16(up[r])));
    });
  }
};
template <int Bits, int Block, bool Half, bool Symmetric>
using Kernel = Avx512<Bits, Block, Half, Symmetric>;
constexpr bool kGates = true;
#endif

#if defined(PAGEDQ_QUANT_AVX2)
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {  // a bfloat16 is the top half of its float32
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float reduce_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t reduce_add(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

template <typename T>
void Activations::quantize_block(const T* x, int64_t n, int8_t* q, float& dx, int32_t& sum) {
  __m256 v[4];
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps();
  for (int64_t i = 0; i < n / 8; ++i) {
    v[i] = load8(x + i * 8);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], magnitude));
  }
  const float m = reduce_max(amax), inv = inverse_step(m);
  __m256i total = _mm256_setzero_si256();
  for (int64_t i = 0; i < n / 8; ++i) {
    const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));  // to nearest even
    total = _mm256_add_epi32(total, qi);
    // |qi| <= 127: the saturating packs keep every value
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i * 8), _mm_packs_epi16(words, words));
  }
  dx = m / 127.f;
  sum = reduce_add(total);
}

// One layout's multiply, 8 columns (half a panel) a register. vpmaddubsw adds pairs of u * qx into int16 with
// saturation: 4-bit u make at most 2 * 15 * 127, but 8-bit u up to 2 * 255 * 127, which does not fit. So 8-bit u
// are multiplied as w = u - 128 (|w| <= 128: pairs of at most 2 * 128 * 127 fit), |w| by qx with w's sign, and the
// 128 * sum(qx) they lack goes into the min term: scale * dx * 128 * sum(qx) = 128 * scale * (dx * sum(qx)).
template <int Bits, int Block, bool Half, bool Symmetric>
struct Avx2 {
  static constexpr Layout kLayout{Bits, Block, Half, Symmetric};
  static constexpr int kQuads = Block / 4;
  static constexpr int64_t kQuantBytes = kLayout.quant_bytes(), kBlockBytes = kLayout.block_bytes();
  static constexpr int64_t kRows = 4;  // rows at a time: 4 int and 4 float accumulators of the 16 registers
#if defined(__AVXVNNI__)
  static constexpr bool kShifted = false;
#else
  static constexpr bool kShifted = Bits == 8;  // u multiplied as u - 128 (above)
#endif

  // dot + the 4-input sums of u * qx, 8 columns: u as loaded from the panel, or shifted and split (w, |w|).
  static __m256i dot4(__m256i dot, __m256i u, __m256i magnitude, __m256i qx) {
#if defined(__AVXVNNI__)
    (void)magnitude;
    return _mm256_dpbusd_avx_epi32(dot, u, qx);
#else
    const __m256i pairs = kShifted ? _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(qx, u))
                                   : _mm256_maddubs_epi16(u, qx);
    return _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
  }

  // 8 of a block's scales or mins (half h of the panel) as float32.
  static __m256 load_scales(const uint8_t* p, int h) {
    if constexpr (Half)
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + h));
    else
      return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + h * 8);
  }

  // Register j of a block's u for 8 columns (half h of the panel).
  static __m256i weights(const uint8_t* q, int j, int h) {
    if constexpr (Bits == 8) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * 64 + h * 32));
      return kShifted ? _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80))) : u;
    } else {
      const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j / 2 * 64 + h * 32));
      return _mm256_and_si256(j % 2 ? _mm256_srli_epi16(both, 4) : both, _mm256_set1_epi8(0x0f));
    }
  }

  // Sums of R rows of a group of S rows (a: the first's words) over half h of a panel, as 8 columns each.
  template <int R>
  static void sum_rows(const uint8_t* q, int64_t blocks, const int32_t* a, int64_t S, int h, __m256* out) {
    const int64_t record = (kQuads + 2) * S;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b, q += kBlockBytes, a += record) {
      // Symmetric: the sums start at offset * sum(qx), so they end at sum((u + offset) * qx); shifted, they are that
      // already (offset is -128, the shift).
      constexpr bool kStartAtOffset = Symmetric && !kShifted;
      __m256i dot[R];
      for (int r = 0; r < R; ++r)
        dot[r] = kStartAtOffset ? _mm256_set1_epi32(a[(kQuads + 1) * S + r]) : _mm256_setzero_si256();
      for (int j = 0; j < kQuads; ++j) {
        const __m256i w = weights(q, j, h), magnitude = kShifted ? _mm256_abs_epi8(w) : w;
        for (int r = 0; r < R; ++r) dot[r] = dot4(dot[r], w, magnitude, _mm256_set1_epi32(a[j * S + r]));
      }
      const auto* dx = reinterpret_cast<const float*>(a + kQuads * S);
      const __m256 scale = load_scales(q + kQuantBytes, h);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(scale, _mm256_set1_ps(dx[r])), acc[r]);
      if constexpr (!Symmetric) {
        __m256 min = load_scales(q + kQuantBytes + kLayout.scales_bytes(), h);
        if constexpr (kShifted) min = _mm256_fmadd_ps(scale, _mm256_set1_ps(128.f), min);
        for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(min, _mm256_set1_ps(dx[S + r]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r];
  }

  template <int R = static_cast<int>(kRows)>
  static void sum_some(const uint8_t* q, int64_t blocks, const int32_t* a, int64_t S, int h, int64_t count,
                       __m256* out) {
    if constexpr (R > 1) {
      if (count < R) return sum_some<R - 1>(q, blocks, a, S, h, count, out);
    }
    sum_rows<R>(q, blocks, a, S, h, out);
  }

  template <typename T>
  static void run(const Activations& a, const uint8_t* panels, int64_t k, const float* bias, int64_t width,
                  int64_t rows, T* out) {
    const int64_t blocks = k / Block;
    for_panels(width, rows, a.group, [&](int64_t p, int64_t g) {
      const uint8_t* panel = panels + p * blocks * kBlockBytes;
      const int64_t in_group = std::min(a.group, rows - g * a.group);
      for (int h = 0; h < 2; ++h) {
        const int64_t col = p * kCols + h * 8, valid = std::min<int64_t>(8, width - col);
        for (int64_t first = 0; first < in_group && valid > 0; first += kRows) {
          __m256 sums[kRows];
          const int64_t count = std::min(kRows, in_group - first);
          sum_some(panel, blocks, a.at(g) + first, a.group, h, count, sums);
          for (int64_t r = 0; r < count; ++r) {
            float v[8];
            _mm256_storeu_ps(v, sums[r]);
            T* row = out + (g * a.group + first + r) * width + col;
            for (int64_t c = 0; c < valid; ++c) row[c] = static_cast<T>(v[c] + (bias ? bias[col + c] : 0.f));
          }
        }
      }
    });
  }
};
template <int Bits, int Block, bool Half, bool Symmetric>
using Kernel = Avx2<Bits, Block, Half, Symmetric>;
constexpr bool kGates = false;  // (the AVX-512 kernel's SiLU)
#endif

#if defined(PAGEDQ_QUANT_AVX512) || defined(PAGEDQ_QUANT_AVX2)
// Layout `layout`'s kernel: the I-th of kLayouts or a later one. gated: width is N / 2 (Avx512::run_gated).
template <size_t I = 0, typename T>
void run_layout(Layout layout, const Activations& a, const uint8_t* panels, int64_t k, const float* bias,
                int64_t width, bool gated, int64_t rows, T* out) {
  if constexpr (I < std::size(kLayouts)) {
    constexpr Layout kLayout = kLayouts[I];
    using K = Kernel<kLayout.bits, kLayout.block, kLayout.half, kLayout.symmetric>;
    if (layout != kLayout) return run_layout<I + 1>(layout, a, panels, k, bias, width, gated, rows, out);
    if constexpr (kGates && std::is_same_v<T, c10::BFloat16>) {
      if (gated) return K::run_gated(a, panels, k, width, rows, out);
    }
    K::run(a, panels, k, bias, width, rows, out);
  }
}

template <typename T>
void run_quant(Layout layout, const T* x, int64_t lda, int64_t rows, int64_t k, const uint8_t* panels,
               const float* bias, int64_t width, bool gated, T* out) {
  Activations a(rows, k, layout);
  // A decode batch's rows are quantized in microseconds: in a parallel region of their own, the threads' start and
  // wait would cost more than they save.
  at::parallel_for(0, rows, rows * k < (1 << 15) ? rows : 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) a.quantize(r, x + r * lda);
  });
  run_layout(layout, a, panels, k, bias, width, gated, rows, out);
}
#endif

}  // namespace

namespace pagedq {

std::string quant_linear_path() {
#if defined(PAGEDQ_QUANT_AVX512)
  return "avx512_vnni";
#elif defined(PAGEDQ_QUANT_AVX2) && defined(__AVXVNNI__)
  return "avx_vnni";
#elif defined(PAGEDQ_QUANT_AVX2)
  return "avx2";
#else
  return "";
#endif
}

// out = x @ w.T (+ bias), or with gated silu(gate) * up [M, N / 2] of panels that alternate gate and up columns
// (kernels/quant_layout.py gated_order; bfloat16 x, the AVX-512 kernel, no bias).
void quant_linear_out(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
                      bool gated, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear: x is float32 or bfloat16 [M, K] rows with a contiguous last dimension");
  const int64_t rows = x.size(0), k = x.size(1), panels = round_up(n, kCols) / kCols, width = gated ? n / 2 : n;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.size(0) == panels &&
                  packed.is_contiguous(),
              "quant_linear: the weight is [ceil(N / 16), bytes a panel] uint8 (kernels/quant_layout.py)");
  const Layout layout = layout_of(packed.size(1), k);
  TORCH_CHECK(!bias || (!gated && bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous()),
              "quant_linear: a float32 bias of N values, not gated");
  const bool gates = x.scalar_type() == at::kBFloat16 && width % kCols == 0 && quant_linear_path() == "avx512_vnni";
  TORCH_CHECK(!gated || gates, "quant_linear: gated is for bfloat16 x, N / 2 a multiple of 16, on the AVX-512 kernel");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.dim() == 2 && out.size(0) == rows &&
                  out.size(1) == width,
              "quant_linear: out is a contiguous [M, ", width, "] tensor in x's dtype");
  TORCH_CHECK(!quant_linear_path().empty(), "quant_linear: not built on this CPU (it needs AVX-512 VNNI or AVX2)");
  if (rows == 0) return;
#if defined(PAGEDQ_QUANT_AVX512) || defined(PAGEDQ_QUANT_AVX2)
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat)
    run_quant(layout, x.data_ptr<float>(), x.stride(0), rows, k, packed.data_ptr<uint8_t>(), b, width, gated,
              out.data_ptr<float>());
  else
    run_quant(layout, x.data_ptr<c10::BFloat16>(), x.stride(0), rows, k, packed.data_ptr<uint8_t>(), b, width,
              gated, out.data_ptr<c10::BFloat16>());
#else
  (void)layout;
#endif
}

}  // namespace pagedq
