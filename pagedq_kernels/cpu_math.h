// What the CPU kernels share (cpu_attention.cpp, cpu_prefill.cpp, cpu_layers.cpp, cpu_linear.cpp): head sizes, work
// balance, float helpers and AMX tiles.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace pagedq {

// The head sizes the attention kernels are built for (the compiler knows D, so loops over it unroll and vectorize);
// other sizes go to the torch ops.
constexpr int64_t kHeadSizes[] = {16, 32, 64, 80, 96, 128, 256};

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

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

// Transposes 16 rows of 16 32-bit words in registers: r[i] is row i before, column i after.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
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

constexpr float kExpOverflow = 88.72283905f;  // exp of more is inf in float32

// float32 to bfloat16, rounded to nearest even as c10::BFloat16 rounds (a NaN stays a NaN).
inline __m256i round_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7fc00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// silu(gate) * up as bfloat16, for gate and up that are bfloat16 values: rounded where torch rounds (the SiLU, then
// the product).
inline __m256i silu_mul16(__m512 gate, __m512 up) {
  const __m512 minus = _mm512_sub_ps(_mm512_setzero_ps(), gate);
  __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(minus)));
  // Where exp(-gate) overflows float32, torch divides by inf: -0, or NaN for gate = -inf (exp16 clamps instead).
  const __mmask16 overflow = _mm512_cmp_ps_mask(minus, _mm512_set1_ps(kExpOverflow), _CMP_GT_OQ);
  silu = _mm512_mask_div_ps(silu, overflow, gate, _mm512_set1_ps(std::numeric_limits<float>::infinity()));
  return round_bf16(_mm512_mul_ps(widen_bf16(round_bf16(silu)), up));
}
#endif

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
// AMX: eight tile registers of up to 16 rows of 64 bytes, and a bfloat16 matrix multiply-add on them (C [M, N]
// float32 += A [M, 32] bfloat16 times B, whose row r holds the pairs 2r, 2r + 1 of N columns). Linux hands out
// the tile state only to a process that asks for it, once.
#define PAGEDQ_AMX 1
inline bool amx_ready() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const bool ready = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return ready;
}

// Whether attention runs on AMX tiles (the decode and prefill kernels' AMX paths): bfloat16, head sizes a multiple
// of 32 (the A tiles' 32 dims), blocks a multiple of 16 tokens (a tile's 16 key rows in one block), up to 16 query
// heads per KV head (the B tiles' 16 columns), and the tile state granted.
inline bool amx_fits(bool bf16, int64_t head_dim, int64_t block_size, int64_t group) {
  return bf16 && head_dim % 32 == 0 && block_size % 16 == 0 && group <= 16 && amx_ready();
}

// The tiles of the calling thread while it lives: all eight 16 rows of 64 bytes.
struct Tiles {
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };
  Tiles() {
    Config c;
    for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = 16;
    _tile_loadconfig(&c);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// Values of 32 tokens as B tiles, for weights (an A tile of 32 tokens) times values: row r of a tile pairs tokens 2r
// and 2r + 1, 16-bit interleaved. A tile holds 16 dimensions of a 64-dimension slice (or of the last 32), in the
// order the interleave, which works within 128-bit lanes, leaves them: tiles 2x and 2x + 1 take turns, 4 dims each,
// over dims [32x, 32x + 32). store_row puts them back.
struct ValueTiles {
  alignas(64) uint32_t tile[4][16][16];

  // first[h]: the slice's row of token 16h, its next 15 tokens `stride` elements apart (one block); tokens from
  // `count` on are zeros (their slots may hold anything).
  void pack(const c10::BFloat16* const first[2], int64_t stride, int64_t count, bool wide) {
    for (int64_t half = 0; half < 2; ++half)
      for (int64_t r = 0; r < 8; ++r) {
        const int64_t a = half * 16 + 2 * r;
        for (int64_t x = 0; x < (wide ? 2 : 1); ++x) {
          const auto load = [&](int64_t t) {
            return t < count ? _mm512_loadu_si512(first[half] + (t - half * 16) * stride + x * 32)
                             : _mm512_setzero_si512();
          };
          const __m512i even = load(a), odd = load(a + 1);
          _mm512_store_si512(tile[2 * x][half * 8 + r], _mm512_unpacklo_epi16(even, odd));
          _mm512_store_si512(tile[2 * x + 1][half * 8 + r], _mm512_unpackhi_epi16(even, odd));
        }
      }
  }

  // C tiles 4-7 (4-5 where not wide) += A tile 3, the weights of the 32 tokens, times these; uses tiles 0 and 1.
  void weigh(bool wide) const {
    _tile_loadd(0, tile[0], sizeof(tile[0][0]));
    _tile_loadd(1, tile[1], sizeof(tile[0][0]));
    _tile_dpbf16ps(4, 3, 0);
    _tile_dpbf16ps(5, 3, 1);
    if (wide) {
      _tile_loadd(0, tile[2], sizeof(tile[0][0]));
      _tile_loadd(1, tile[3], sizeof(tile[0][0]));
      _tile_dpbf16ps(6, 3, 0);
      _tile_dpbf16ps(7, 3, 1);
    }
  }
};

// C tiles 4-7 zeroed, for a new sum.
inline void zero_sums() {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
}

// C tiles 4-7 stored as the columns [0, 64) of 16 rows `stride` floats apart.
inline void store_sums(float* out, int64_t stride) {
  const int64_t bytes = stride * static_cast<int64_t>(sizeof(float));
  _tile_stored(4, out, bytes);
  _tile_stored(5, out + 16, bytes);
  _tile_stored(6, out + 32, bytes);
  _tile_stored(7, out + 48, bytes);
}

// One row of stored sums (ValueTiles' column order) times `scale`, in dimension order as bfloat16: 64 dims, or 32
// where not wide.
inline void store_row(const float* sums, float scale, bool wide, c10::BFloat16* out) {
  const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i high = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 f = _mm512_set1_ps(scale);
  for (int64_t x = 0; x < (wide ? 2 : 1); ++x) {
    const __m512 a = _mm512_loadu_ps(sums + 32 * x), b = _mm512_loadu_ps(sums + 32 * x + 16);
    const __m512 lo = _mm512_mul_ps(_mm512_permutex2var_ps(a, low, b), f);
    const __m512 hi = _mm512_mul_ps(_mm512_permutex2var_ps(a, high, b), f);
    const __m512bh both = _mm512_cvtne2ps_pbh(hi, lo);
    std::memcpy(out + 32 * x, &both, sizeof both);
  }
}
#endif

}  // namespace pagedq
