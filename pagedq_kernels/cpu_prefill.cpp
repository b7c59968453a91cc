// Prefill attention on the CPU that reads the paged KV cache in place: the new tokens of a sequence with more than
// one (a prompt, a chunk of one, the rest of a prompt after a prefix-cache hit) attend causally to its keys. A work
// item is a tile of query tokens and one KV head: the query heads that share that KV head are rows of the same tile,
// so each key and value is loaded and converted once for all of them. Keys come in tiles of kTile with an online
// softmax (flash attention), and tiles past a query tile's last position are never read. Items go to the threads
// by their cost. Built with cpu_attention.cpp (kernels/cpu_ops.py), registered as torch.ops.pagedq.prefill_attention.
//
// Layouts as in cpu_attention.cpp; query_start_loc [B + 1] int64, seqs [n] int64: the sequences to attend.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_library.h"
#include "cpu_math.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

// An item's rows are its query tokens times the query heads of its KV head, at most kRows (three registers of 16
// float32 lanes): the rows are the lanes, so the softmax over keys is lane-wise, with no sum across a register.
constexpr int64_t kRows = 48;
constexpr int64_t kTile = 32;  // keys per tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Item {
  int64_t seq, first, tokens, head;  // `tokens` new tokens of `seq` from its `first`, against KV head `head`
};

template <typename T>
struct Args {
  const T *q, *k, *v;
  T* out;
  const int64_t* starts;  // query_start_loc
  const int32_t *lens, *tables;
  int64_t q_heads, kv_heads, head_dim, block_size, table_stride;
  float scale;
};

template <typename T>
inline const T* cache_row(const T* cache, const int32_t* table, int64_t pos, int64_t head, const Args<T>& a) {
  const int64_t block = table[pos / a.block_size];
  return cache + ((block * a.block_size + pos % a.block_size) * a.kv_heads + head) * a.head_dim;
}

// Where an item's rows live: row r is query head r % group of token r / group, and the query heads of a KV head
// are adjacent in q, so the item's rows of one token are one run of group * head_dim values.
template <typename T>
struct Rows {
  int64_t group, rows, first_pos, offset, token_stride;
  Rows(const Args<T>& a, const Item& it)
      : group(a.q_heads / a.kv_heads), rows(it.tokens * group),
        first_pos(a.lens[it.seq] - (a.starts[it.seq + 1] - a.starts[it.seq]) + it.first),
        offset((a.starts[it.seq] + it.first) * a.q_heads * a.head_dim + it.head * group * a.head_dim),
        token_stride(a.q_heads * a.head_dim) {}
  int64_t at(int64_t r, int64_t d, int64_t head_dim) const {
    return offset + (r / group) * token_stride + (r % group) * head_dim + d;
  }
  int64_t keys() const { return first_pos + rows / group; }  // the last token sees every key up to its own
  // A padding row (past the item's rows) sits at the last token's position: masked like it, and finite.
  float pos(int64_t r) const { return static_cast<float>(first_pos + std::min(r, rows - 1) / group); }
};

#if defined(__AVX512F__)
// The AVX-512 path, for every dtype: float32 products and sums, 16 rows to a register. Keys and values of another
// dtype are converted to float32 once per tile, for all the tile's rows. (bfloat16 pairs summed by AVX-512 BF16's
// dot-product instruction measured 1.3-1.5x slower here than float32 multiply-adds, which issue twice as often.)
constexpr int64_t kLanes = 16, kChunks = kRows / kLanes;

template <int64_t D>
struct VecScratch {
  alignas(64) float qt[D][kRows];     // the queries, transposed: rows are lanes
  alignas(64) float ot[D][kRows];     // the running output, transposed
  alignas(64) float s[kTile][kRows];  // a tile's scores, then its weights
  alignas(64) float k[kTile][D], v[kTile][D];
  alignas(64) float m[kRows], l[kRows], pos[kRows], alpha[kRows];
};

inline void prefetch_row(const void* row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(row) + b);
}

// A row of D values as float32; past the sequence's end (row null), zeros: those slots may hold anything.
template <typename T, int64_t D>
inline void load_row(const T* row, float* out) {
  if (row == nullptr) {
    std::memset(out, 0, D * sizeof(float));
  } else if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, row, D * sizeof(float));
  } else if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>) {
    for (int64_t d = 0; d < D; d += kLanes) _mm512_storeu_ps(out + d, pagedq::load16(row + d));
  } else {
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(row[d]);
  }
}

// Scores of the tile's keys (four at a time: 4 x C accumulators), scaled and causally masked. C: the registers of
// 16 rows an item fills (a verify step's few tokens, one; a prompt's, three): lanes past them are padding.
template <int64_t D, int64_t C>
inline void vec_scores(VecScratch<D>& w, int64_t j0, float scale) {
  constexpr int64_t kKeys = 4;
  for (int64_t j = 0; j < kTile; j += kKeys) {
    __m512 acc[kKeys][C];
    for (auto& row : acc)
      for (auto& x : row) x = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      __m512 q[C];
      for (int64_t c = 0; c < C; ++c) q[c] = _mm512_load_ps(&w.qt[d][c * kLanes]);
      for (int64_t kk = 0; kk < kKeys; ++kk) {
        const __m512 key = _mm512_set1_ps(w.k[j + kk][d]);
        for (int64_t c = 0; c < C; ++c) acc[kk][c] = _mm512_fmadd_ps(q[c], key, acc[kk][c]);
      }
    }
    for (int64_t kk = 0; kk < kKeys; ++kk) {
      const __m512 key_pos = _mm512_set1_ps(static_cast<float>(j0 + j + kk));
      for (int64_t c = 0; c < C; ++c) {
        const __mmask16 seen = _mm512_cmp_ps_mask(key_pos, _mm512_load_ps(&w.pos[c * kLanes]), _CMP_LE_OQ);
        const __m512 score = _mm512_mul_ps(acc[kk][c], _mm512_set1_ps(scale));
        _mm512_store_ps(&w.s[j + kk][c * kLanes], _mm512_mask_blend_ps(seen, _mm512_set1_ps(kNegInf), score));
      }
    }
  }
}

// The tile's scores to weights (in place) against the new running max; alpha rescales what came before.
template <int64_t D, int64_t C>
inline void vec_softmax(VecScratch<D>& w) {
  for (int64_t c = 0; c < C * kLanes; c += kLanes) {
    const __m512 old = _mm512_load_ps(&w.m[c]);
    __m512 top = old;
    for (int64_t j = 0; j < kTile; ++j) top = _mm512_max_ps(top, _mm512_load_ps(&w.s[j][c]));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < kTile; ++j) {
      const __m512 e = pagedq::exp16(_mm512_sub_ps(_mm512_load_ps(&w.s[j][c]), top));
      _mm512_store_ps(&w.s[j][c], e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 alpha = pagedq::exp16(_mm512_sub_ps(old, top));  // the first tile: exp(-inf), about 0
    _mm512_store_ps(&w.alpha[c], alpha);
    _mm512_store_ps(&w.l[c], _mm512_fmadd_ps(_mm512_load_ps(&w.l[c]), alpha, sum));
    _mm512_store_ps(&w.m[c], top);
  }
}

// out = out * alpha + weights x values, eight dimensions at a time (8 x C accumulators).
template <int64_t D, int64_t C>
inline void vec_values(VecScratch<D>& w) {
  constexpr int64_t kDims = 8;
  for (int64_t d0 = 0; d0 < D; d0 += kDims) {
    __m512 acc[kDims][C];
    for (int64_t dd = 0; dd < kDims; ++dd)
      for (int64_t c = 0; c < C; ++c)
        acc[dd][c] = _mm512_mul_ps(_mm512_load_ps(&w.ot[d0 + dd][c * kLanes]), _mm512_load_ps(&w.alpha[c * kLanes]));
    for (int64_t j = 0; j < kTile; ++j) {
      __m512 p[C];
      for (int64_t c = 0; c < C; ++c) p[c] = _mm512_load_ps(&w.s[j][c * kLanes]);
      for (int64_t dd = 0; dd < kDims; ++dd) {
        const __m512 value = _mm512_set1_ps(w.v[j][d0 + dd]);
        for (int64_t c = 0; c < C; ++c) acc[dd][c] = _mm512_fmadd_ps(p[c], value, acc[dd][c]);
      }
    }
    for (int64_t dd = 0; dd < kDims; ++dd)
      for (int64_t c = 0; c < C; ++c) _mm512_store_ps(&w.ot[d0 + dd][c * kLanes], acc[dd][c]);
  }
}

// The item's queries, transposed: float32 and bfloat16 by gathers of 16 rows from its first row (a bfloat16 pair
// gathered as one 32-bit word and split); other dtypes one by one. Padding rows are zeros.
template <typename T, int64_t D>
inline void load_queries(const Args<T>& a, const Rows<T>& rows, VecScratch<D>& w) {
  constexpr bool kFloat = std::is_same_v<T, float>, kBf16 = std::is_same_v<T, at::BFloat16>;
  if constexpr (kFloat || kBf16) {
    constexpr int64_t kPerWord = kFloat ? 1 : 2;
    const auto* base = reinterpret_cast<const int32_t*>(a.q + rows.at(0, 0, D));
    for (int64_t c = 0; c < kRows; c += kLanes) {
      alignas(64) int32_t at[kLanes];
      for (int64_t i = 0; i < kLanes; ++i)
        at[i] = static_cast<int32_t>(c + i < rows.rows ? (rows.at(c + i, 0, D) - rows.at(0, 0, D)) / kPerWord : 0);
      const __m512i index = _mm512_load_si512(at);
      const __mmask16 real = static_cast<__mmask16>((1u << std::clamp<int64_t>(rows.rows - c, 0, kLanes)) - 1);
      for (int64_t u = 0; u < D / kPerWord; ++u) {
        const __m512i at_u = _mm512_add_epi32(index, _mm512_set1_epi32(static_cast<int32_t>(u)));
        const __m512i x = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, at_u, base, 4);
        if constexpr (kFloat) {
          _mm512_store_si512(&w.qt[u][c], x);
        } else {
          __m512 first, second;
          pagedq::split_bf16_pairs(x, first, second);
          _mm512_store_ps(&w.qt[2 * u][c], first);
          _mm512_store_ps(&w.qt[2 * u + 1][c], second);
        }
      }
    }
  } else {
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t d = 0; d < D; ++d) w.qt[d][r] = r < rows.rows ? static_cast<float>(a.q[rows.at(r, d, D)]) : 0.f;
  }
}

template <typename T, int64_t D, int64_t C>
void attend_item(const Args<T>& a, const Item& it, VecScratch<D>& w) {
  const Rows<T> rows(a, it);
  const int32_t* table = a.tables + it.seq * a.table_stride;
  load_queries(a, rows, w);
  std::memset(w.ot, 0, sizeof w.ot);
  for (int64_t r = 0; r < kRows; ++r) {
    w.m[r] = kNegInf;
    w.l[r] = 0.f;
    w.pos[r] = rows.pos(r);
  }
  const int64_t keys = rows.keys();
  for (int64_t j0 = 0; j0 < keys; j0 += kTile) {
    const int64_t n = std::min(kTile, keys - j0);
    const T* values[kTile];  // past n, none
    for (int64_t j = 0; j < kTile; ++j) {
      values[j] = j < n ? cache_row(a.v, table, j0 + j, it.head, a) : nullptr;
      if (values[j] != nullptr) prefetch_row(values[j], D * sizeof(T));  // read after the scores
      load_row<T, D>(j < n ? cache_row(a.k, table, j0 + j, it.head, a) : nullptr, w.k[j]);
    }
    vec_scores<D, C>(w, j0, a.scale);
    vec_softmax<D, C>(w);
    for (int64_t j = 0; j < kTile; ++j) load_row<T, D>(values[j], w.v[j]);
    vec_values<D, C>(w);
  }
  for (int64_t r = 0; r < rows.rows; ++r)
    for (int64_t d = 0; d < D; ++d) a.out[rows.at(r, d, D)] = static_cast<T>(w.ot[d][r] / w.l[r]);
}

#if defined(PAGEDQ_AMX)
// The AMX path (where pagedq::amx_fits). An item is 16 rows (whole tokens' query heads; padding rows past them), in
// three passes, as the decode kernel: scores of every key the item sees, as C tiles of 16 keys by the rows, from the
// keys' rows as they sit in the block (A tiles) and the queries transposed (B tiles); the exact softmax, lane-wise
// (rows in lanes), its weights transposed in registers into A tiles of 16 rows by 32 keys in bfloat16; then weights
// times the values, packed into B tiles, summed in the C tiles over all keys, a 64-dim slice at a time, with nothing to
// rescale. Tiles: all eight for the scores, then values 0-1 (B), 3 (A), 4-7 (C), as in the decode kernel.
constexpr int64_t kAmxRows = 16, kAmxKeys = 32, kAmxDims = 64;

template <int64_t D>
struct AmxScratch {
  alignas(64) uint32_t qt[D / 32][16][kAmxRows];  // B tiles: row r of tile c, dims 32c + 2r and + 1, by row
  alignas(64) float sums[kAmxRows][kAmxDims];       // one slice of weighted values
  std::vector<float> s;                             // scores, then weights: keys by rows
  std::vector<uint32_t> p;                          // the weights as A tiles: per 32 keys, rows by key pairs
  pagedq::ValueTiles values;
};

template <int64_t D>
void amx_load_queries(const Args<at::BFloat16>& a, const Rows<at::BFloat16>& rows, AmxScratch<D>& w) {
  std::memset(w.qt, 0, sizeof w.qt);
  for (int64_t r = 0; r < rows.rows; ++r) {
    const auto* words = reinterpret_cast<const uint32_t*>(a.q + rows.at(r, 0, D));
    for (int64_t u = 0; u < D / 2; ++u) w.qt[u / 16][u % 16][r] = words[u];
  }
}

// Scores of keys [0, keys) (rounded up to 32) into w.s, scaled and causally masked -> each row's maximum.
template <int64_t D>
__m512 amx_scores(const Args<at::BFloat16>& a, const int32_t* table, int64_t head, int64_t keys, __m512 pos,
                  AmxScratch<D>& w) {
  const int64_t row_bytes = a.kv_heads * D * static_cast<int64_t>(sizeof(at::BFloat16));
  const int64_t padded = pagedq::round_up(keys, kAmxKeys);
  w.s.resize(padded * kAmxRows);
  // Two chunks of 16 keys at once, in tiles 0, 1, 6 and 4, 5, 7, so that one's multiply-adds run while the other's
  // wait; the queries' B tiles (2, 3) stay loaded where there are at most two.
  constexpr int64_t kChunks = D / 32;
  constexpr bool kResident = kChunks <= 2;
  if constexpr (kResident) {
    _tile_loadd(2, w.qt[0], sizeof(w.qt[0][0]));
    if constexpr (kChunks == 2) _tile_loadd(3, w.qt[1], sizeof(w.qt[0][0]));
  }
  for (int64_t k0 = 0; k0 < keys; k0 += kAmxKeys) {
    const at::BFloat16* first = cache_row(a.k, table, k0, head, a);  // its block holds the next 15 rows
    // Past the sequence's keys, the first chunk again: its scores land past `keys`, where they are masked.
    const at::BFloat16* second = k0 + 16 < keys ? cache_row(a.k, table, k0 + 16, head, a) : first;
    _tile_zero(0);
    _tile_zero(4);
    for (int64_t c = 0; c < kChunks; c += 2) {
      if constexpr (!kResident) _tile_loadd(2, w.qt[c], sizeof(w.qt[0][0]));
      _tile_loadd(1, first + c * 32, row_bytes);
      _tile_loadd(5, second + c * 32, row_bytes);
      _tile_dpbf16ps(0, 1, 2);
      _tile_dpbf16ps(4, 5, 2);
      if (c + 1 < kChunks) {
        if constexpr (!kResident) _tile_loadd(3, w.qt[c + 1], sizeof(w.qt[0][0]));
        _tile_loadd(6, first + (c + 1) * 32, row_bytes);
        _tile_loadd(7, second + (c + 1) * 32, row_bytes);
        _tile_dpbf16ps(0, 6, 3);
        _tile_dpbf16ps(4, 7, 3);
      }
    }
    _tile_stored(0, w.s.data() + k0 * kAmxRows, kAmxRows * sizeof(float));
    _tile_stored(4, w.s.data() + (k0 + 16) * kAmxRows, kAmxRows * sizeof(float));
  }
  const __m512 scale = _mm512_set1_ps(a.scale), none = _mm512_set1_ps(kNegInf);
  __m512 top = none;
  for (int64_t j = 0; j < padded; ++j) {  // keys past the sequence's are past every row's position too
    float* row = w.s.data() + j * kAmxRows;
    const __mmask16 seen = _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(j)), pos, _CMP_LE_OQ);
    const __m512 x = _mm512_mask_blend_ps(seen, none, _mm512_mul_ps(_mm512_loadu_ps(row), scale));
    _mm512_storeu_ps(row, x);
    top = _mm512_max_ps(top, x);
  }
  return top;
}

// The softmax's weights, as A tiles of 16 rows by 32 keys in bfloat16 (w.p) -> 1 / each row's sum.
template <int64_t D>
__m512 amx_softmax(int64_t keys, __m512 top, AmxScratch<D>& w) {
  const int64_t tiles = (keys + kAmxKeys - 1) / kAmxKeys;
  w.p.resize(tiles * kAmxRows * 16);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < tiles; ++t) {
    __m512i pairs[16];
    for (int64_t r = 0; r < 16; ++r) {
      const float* even_row = w.s.data() + (t * kAmxKeys + 2 * r) * kAmxRows;
      const __m512 even = pagedq::exp16(_mm512_sub_ps(_mm512_loadu_ps(even_row), top));
      const __m512 odd = pagedq::exp16(_mm512_sub_ps(_mm512_loadu_ps(even_row + kAmxRows), top));
      sum = _mm512_add_ps(sum, _mm512_add_ps(even, odd));
      const __m256bh e = _mm512_cvtneps_pbh(even), o = _mm512_cvtneps_pbh(odd);
      __m256i e16, o16;
      std::memcpy(&e16, &e, sizeof e16);
      std::memcpy(&o16, &o, sizeof o16);
      pairs[r] = _mm512_or_si512(_mm512_cvtepu16_epi32(e16), _mm512_slli_epi32(_mm512_cvtepu16_epi32(o16), 16));
    }
    pagedq::transpose16(pairs);  // lanes were rows: now pairs[row] holds the row's 16 key pairs
    for (int64_t r = 0; r < kAmxRows; ++r) _mm512_storeu_si512(w.p.data() + (t * kAmxRows + r) * 16, pairs[r]);
  }
  return _mm512_div_ps(_mm512_set1_ps(1.f), sum);
}

// out = (weights x values) / sum for the item's rows, a 64-dim slice at a time.
template <int64_t D>
void amx_values(const Args<at::BFloat16>& a, const Rows<at::BFloat16>& rows, const int32_t* table, int64_t head,
                int64_t keys, __m512 inv, AmxScratch<D>& w) {
  alignas(64) float inv_rows[kAmxRows];
  _mm512_store_ps(inv_rows, inv);
  for (int64_t d0 = 0; d0 < D; d0 += kAmxDims) {
    const bool wide = D - d0 >= kAmxDims;
    const auto row_of = [&](int64_t t) -> const at::BFloat16* {
      return t < keys ? cache_row(a.v, table, t, head, a) + d0 : nullptr;
    };
    pagedq::zero_sums();
    for (int64_t j0 = 0, t = 0; j0 < keys; j0 += kAmxKeys, ++t) {
      const at::BFloat16* first[2] = {row_of(j0), row_of(j0 + 16)};
      w.values.pack(first, a.kv_heads * D, keys - j0, wide);
      _tile_loadd(3, w.p.data() + t * kAmxRows * 16, 16 * sizeof(uint32_t));
      w.values.weigh(wide);
    }
    pagedq::store_sums(&w.sums[0][0], kAmxDims);
    for (int64_t r = 0; r < rows.rows; ++r) pagedq::store_row(w.sums[r], inv_rows[r], wide, a.out + rows.at(r, d0, D));
  }
}

template <int64_t D>
void attend_item_amx(const Args<at::BFloat16>& a, const Item& it, AmxScratch<D>& w) {
  const Rows<at::BFloat16> rows(a, it);
  const int32_t* table = a.tables + it.seq * a.table_stride;
  amx_load_queries(a, rows, w);
  alignas(64) float pos[kAmxRows];
  for (int64_t r = 0; r < kAmxRows; ++r) pos[r] = rows.pos(r);
  const int64_t keys = rows.keys();
  const __m512 top = amx_scores(a, table, it.head, keys, _mm512_load_ps(pos), w);
  amx_values(a, rows, table, it.head, keys, amx_softmax(keys, top, w), w);
}
#endif

using pagedq::kHeadSizes;

// One thread's bins of items, with its scratch for head size D.
template <typename T, int64_t D>
void attend_items(const Args<T>& a, const std::vector<Item>* bins, int64_t begin, int64_t end, bool amx) {
#if defined(PAGEDQ_AMX)
  if constexpr (std::is_same_v<T, at::BFloat16> && D % 32 == 0) {
    if (amx) {
      const pagedq::Tiles tiles;
      auto w = std::make_unique<AmxScratch<D>>();
      for (int64_t b = begin; b < end; ++b)
        for (const Item& it : bins[b]) attend_item_amx<D>(a, it, *w);
      return;
    }
  }
#endif
  auto w = std::make_unique<VecScratch<D>>();
  const int64_t group = a.q_heads / a.kv_heads;
  for (int64_t b = begin; b < end; ++b)
    for (const Item& it : bins[b]) {
      const int64_t registers = (it.tokens * group + kLanes - 1) / kLanes;
      if (registers == 1)
        attend_item<T, D, 1>(a, it, *w);
      else if (registers == 2)
        attend_item<T, D, 2>(a, it, *w);
      else
        attend_item<T, D, kChunks>(a, it, *w);
    }
}

template <typename T, size_t I = 0>
void attend_any(const Args<T>& a, const std::vector<Item>* bins, int64_t begin, int64_t end, bool amx) {
  if constexpr (I < std::size(kHeadSizes)) {
    if (a.head_dim == kHeadSizes[I]) {
      attend_items<T, kHeadSizes[I]>(a, bins, begin, end, amx);
    } else {
      attend_any<T, I + 1>(a, bins, begin, end, amx);
    }
  }
}

// The rows of an item where this call runs on AMX tiles (pagedq::amx_fits), else 0.
int64_t amx_rows(at::ScalarType dtype, int64_t head_dim, int64_t block_size, int64_t group) {
#if defined(PAGEDQ_AMX)
  return pagedq::amx_fits(dtype == at::kBFloat16, head_dim, block_size, group) ? kAmxRows : 0;
#else
  return 0;
#endif
}

// Items cut from each sequence's new tokens, in bins of about equal cost, one per thread (a late tile of a long
// prompt sees many more keys than an early one).
std::vector<std::vector<Item>> plan(const int64_t* seqs, int64_t n, const int64_t* starts, const int32_t* lens,
                                    int64_t group, int64_t kv_heads, int64_t bins, int64_t rows_per_item) {
  const int64_t per_item = rows_per_item / group;
  std::vector<Item> items;
  std::vector<int64_t> costs;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = seqs[i], q_len = starts[b + 1] - starts[b], cached = lens[b] - q_len;
    for (int64_t first = 0; first < q_len; first += per_item) {
      const int64_t tokens = std::min(per_item, q_len - first);
      for (int64_t h = 0; h < kv_heads; ++h) {
        items.push_back({b, first, tokens, h});
        costs.push_back(cached + first + tokens);  // keys seen
      }
    }
  }
  std::vector<std::vector<Item>> out;
  for (const auto& bin : pagedq::balance(costs, bins)) {
    out.emplace_back();
    for (const int64_t i : bin) out.back().push_back(items[i]);
  }
  return out;
}

}  // namespace

namespace pagedq {

void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& seqs, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                       const at::Tensor& block_table, double scale, at::Tensor out) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "prefill_attention: q, out and the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "prefill_attention: q, out and the caches must share a dtype");
  TORCH_CHECK(seqs.scalar_type() == at::kLong && query_start_loc.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kInt && block_table.scalar_type() == at::kInt,
              "prefill_attention: int64 seqs and query_start_loc, int32 seq_lens and block_table");
  TORCH_CHECK(seqs.is_contiguous() && query_start_loc.is_contiguous() && seq_lens.is_contiguous() &&
                  block_table.is_contiguous(),
              "prefill_attention: the index tensors must be contiguous");
  const int64_t q_heads = q.size(1), head_dim = q.size(2), kv_heads = k_cache.size(2);
  TORCH_CHECK(q_heads % kv_heads == 0 && k_cache.size(3) == head_dim && v_cache.sizes() == k_cache.sizes(),
              "prefill_attention: head shapes");
  TORCH_CHECK(std::find(std::begin(kHeadSizes), std::end(kHeadSizes), head_dim) != std::end(kHeadSizes),
              "prefill_attention: head size ", head_dim, " is not built");
  const int64_t n = seqs.numel(), batch = seq_lens.numel(), block_size = k_cache.size(1);
  const int64_t* seq_p = seqs.data_ptr<int64_t>();
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(query_start_loc.numel() == batch + 1 && block_table.size(0) >= batch,
              "prefill_attention: a query start and a block table row per sequence");
  // Cheap bounds, per sequence: a kernel that reads memory by index must not read past its tensors.
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = seq_p[i];
    TORCH_CHECK(b >= 0 && b < batch, "prefill_attention: sequence ", b, " out of range");
    const int64_t q_len = starts[b + 1] - starts[b];
    TORCH_CHECK(starts[b] >= 0 && q_len >= 0 && starts[b + 1] <= q.size(0), "prefill_attention: sequence ", b,
                "'s query rows are out of range");
    TORCH_CHECK(lens[b] >= q_len && lens[b] <= block_table.size(1) * block_size, "prefill_attention: sequence ", b,
                " holds ", lens[b], " tokens: fewer than its new tokens or more than its block table row");
    const int32_t* row = block_table.data_ptr<int32_t>() + b * block_table.size(1);
    for (int64_t j = 0; j < (lens[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(row[j] >= 0 && row[j] < k_cache.size(0), "prefill_attention: block ", row[j], " out of range");
  }
  const int64_t group = q_heads / kv_heads;
  TORCH_CHECK(group <= kRows, "prefill_attention: more than ", kRows, " query heads per KV head");
  const int64_t tile_rows = amx_rows(q.scalar_type(), head_dim, block_size, group);
  const bool amx = tile_rows > 0;
  const auto bins = plan(seq_p, n, starts, lens, group, kv_heads, at::get_num_threads(), amx ? tile_rows : kRows);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention", [&] {
    const Args<scalar_t> a{q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                           out.data_ptr<scalar_t>(), starts, lens, block_table.data_ptr<int32_t>(), q_heads,
                           kv_heads, head_dim, block_size, block_table.size(1), static_cast<float>(scale)};
    at::parallel_for(0, static_cast<int64_t>(bins.size()), 1,
                     [&](int64_t begin, int64_t end) { attend_any<scalar_t>(a, bins.data(), begin, end, amx); });
  });
}

#else
}  // namespace

namespace pagedq {

// Without AVX-512 there is no kernel: the torch ops serve prefills (kernels/cpu_ops.py asks prefill_max_group).
void prefill_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, const at::Tensor&, double, at::Tensor) {
  TORCH_CHECK(false, "prefill_attention: not built for a CPU without AVX-512");
}
#endif

int64_t prefill_max_group() {
#if defined(__AVX512F__)
  return kRows;
#else
  return 0;
#endif
}
}  // namespace pagedq

TORCH_LIBRARY_IMPL(pagedq, CPU, m) { m.impl("prefill_attention", &pagedq::prefill_attention); }
