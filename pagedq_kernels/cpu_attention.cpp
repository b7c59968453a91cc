// Decode attention on the CPU that reads the paged KV cache in place: one work item per sequence, KV head by KV
// head, whose query heads share every key and value it loads. Built on first use by kernels/cpu_ops.py, for the CPU
// it runs on (-march=native), and registered as torch.ops.pagedq.decode_attention: an opaque op to the compiler.
//
// Layouts (kernels/__init__.py): q, out [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D];
// block_table [B, max_blocks] int32; seq_lens [B] int32. rows[i] is the token row of the i-th decode query and
// seqs[i] its sequence (its block table row and length).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_library.h"
#include "cpu_math.h"

#include <immintrin.h>

#include <algorithm>
#include <iterator>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

struct Shape {
  int64_t q_heads, kv_heads, head_dim, block_size, table_stride;
  float scale;
};

// A row of keys or values as float32: T's row converted once, then used by every query of the group.
template <typename T, int64_t D>
inline const float* as_floats(const T* row, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    for (int64_t d = 0; d < D; ++d) buf[d] = static_cast<float>(row[d]);
    return buf;
  }
}

// The next block's rows of one head (up to `left` of them), before they are read: blocks are scattered, where the
// hardware prefetcher cannot guess.
template <typename T, int kLocality = 3>  // __builtin_prefetch's: 3 is prefetcht0, into L1
inline void prefetch_block(const T* head, int64_t left, const Shape& s) {
  const int64_t token_stride = s.kv_heads * s.head_dim, row_bytes = s.head_dim * static_cast<int64_t>(sizeof(T));
  const char* next = reinterpret_cast<const char*>(head);
  for (int64_t o = 0; o < std::min(s.block_size, left); ++o)
    for (int64_t c = 0; c < row_bytes; c += 64)
      __builtin_prefetch(next + o * token_stride * sizeof(T) + c, 0, kLocality);
}

// Calls f(t, row) for the rows of tokens [0, len) of one head, block by block: no division per token.
template <typename T, typename F>
inline void for_each_row(const T* head, const int32_t* table, int64_t len, const Shape& s, F f) {
  const int64_t token_stride = s.kv_heads * s.head_dim, block_stride = s.block_size * token_stride;
  for (int64_t t = 0, b = 0; t < len; ++b) {
    const T* row = head + static_cast<int64_t>(table[b]) * block_stride;
    const int64_t end = std::min(len, t + s.block_size);
    if (end < len) prefetch_block(head + static_cast<int64_t>(table[b + 1]) * block_stride, len - end, s);
    for (; t < end; ++t, row += token_stride) f(t, row);
  }
}

// Scores of `group` queries (float32, pre-scaled) against keys [0, len) of one KV head; each key is loaded once.
template <typename T, int64_t D>
void scores(const float* qf, const T* k_head, const int32_t* table, int64_t len, const Shape& s, int64_t group,
            float* out) {
  float buf[D];
  for_each_row(k_head, table, len, s, [&](int64_t t, const T* row) {
    const float* k = as_floats<T, D>(row, buf);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * D;
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += qg[d] * k[d];
      out[g * len + t] = acc;
    }
  });
}

// Softmax of each query's row in place, but for the division by its sum: inv[g] is 1 / sum, applied to the weighted
// values instead (a pass over D values, not over every key).
inline void softmax_rows(float* p, int64_t rows, int64_t len, float* inv) {
  for (int64_t g = 0; g < rows; ++g) {
    float* r = p + g * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) m = std::max(m, r[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      r[t] = pagedq::fast_exp(r[t] - m);
      sum += r[t];
    }
    inv[g] = 1.f / sum;
  }
}

// acc[g] = sum_t p[g, t] * v[t] for each query of the group; each value row is loaded once.
template <typename T, int64_t D>
void weighted_values(const float* __restrict p, const T* v_head, const int32_t* table, int64_t len,
                     const Shape& s, int64_t group, float* __restrict acc) {
  float buf[D];
  std::fill(acc, acc + group * D, 0.f);
  for_each_row(v_head, table, len, s, [&](int64_t t, const T* row) {
    const float* __restrict v = as_floats<T, D>(row, buf);
    for (int64_t g = 0; g < group; ++g) {
      const float w = p[g * len + t];
      float* __restrict a = acc + g * D;
      for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
    }
  });
}

#if defined(__AVX512F__)
// The AVX-512 path, float32 and bfloat16: 16 keys at a time, one to a lane. A chunk of 16 tokens of one block sits
// at a fixed stride, so their rows are loaded and transposed in registers (or, where a row is not whole registers
// or a block not whole chunks, each 32-bit word gathered), a bfloat16 pair split into two float32 values, and up to
// four query heads are scored against each word with multiply-adds: no sum across a register per key, which a
// key-by-key dot product pays. Values are summed in registers, a token's row at a time.
constexpr int64_t kLanes = 16, kHeadsAtOnce = 4;

template <typename T>
constexpr bool kLanePath = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>;

// Query heads padded to a multiple of kHeadsAtOnce: their rows of queries and weights are zeros.
inline int64_t padded_group(int64_t group) { return (group + kHeadsAtOnce - 1) / kHeadsAtOnce * kHeadsAtOnce; }

using pagedq::transpose16;

// Scores of `group` queries (float32, pre-scaled; rows padded to padded_group) against keys [0, len) of one head.
template <typename T, int64_t D>
void scores_lanes(const float* qf, const T* k_head, const int32_t* table, int64_t len, const Shape& s,
                  int64_t group, float* out) {
  constexpr int64_t kPerWord = sizeof(uint32_t) / sizeof(T);
  const int64_t token_stride = s.kv_heads * s.head_dim, block_stride = s.block_size * token_stride;
  const __m512i tokens = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int32_t>(token_stride / kPerWord)));
  constexpr int64_t kWords = D / kPerWord;
  const int64_t word_stride = token_stride / kPerWord;
  // Chunks of 16 tokens then never cross a block, and a short one still reads its block's rows (unused lanes).
  const bool transposed = kWords % kLanes == 0 && s.block_size % kLanes == 0;
  __m512i words[kWords % kLanes == 0 ? kWords : 1];
  for (int64_t t = 0, b = 0; t < len; ++b) {
    const T* block = k_head + static_cast<int64_t>(table[b]) * block_stride;
    const int64_t end = std::min(len, t + s.block_size);
    if (end < len) prefetch_block(k_head + static_cast<int64_t>(table[b + 1]) * block_stride, len - end, s);
    for (int64_t t0 = t; t0 < end; t0 += kLanes) {
      const int64_t n = std::min(kLanes, end - t0);
      const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1);
      const auto* base = reinterpret_cast<const int32_t*>(block + (t0 - t) * token_stride);
      if constexpr (kWords % kLanes == 0) {  // (the array holds whole registers of words only then)
        for (int64_t c = 0; transposed && c < kWords / kLanes; ++c) {
          for (int64_t i = 0; i < kLanes; ++i) words[c * kLanes + i] = _mm512_loadu_si512(base + i * word_stride + c * kLanes);
          transpose16(words + c * kLanes);
        }
      }
      for (int64_t g0 = 0; g0 < group; g0 += kHeadsAtOnce) {
        const float* q = qf + g0 * D;
        __m512 acc[kHeadsAtOnce];
        for (auto& a : acc) a = _mm512_setzero_ps();
        for (int64_t u = 0; u < kWords; ++u) {
          const __m512i word = transposed ? words[u] : _mm512_mask_i32gather_epi32(
              _mm512_setzero_si512(), lanes, _mm512_add_epi32(tokens, _mm512_set1_epi32(static_cast<int32_t>(u))), base, 4);
          if constexpr (kPerWord == 1) {
            const __m512 k = _mm512_castsi512_ps(word);
            for (int64_t g = 0; g < kHeadsAtOnce; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + u]), k, acc[g]);
          } else {
            __m512 even, odd;
            pagedq::split_bf16_pairs(word, even, odd);
            for (int64_t g = 0; g < kHeadsAtOnce; ++g) {
              acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + 2 * u]), even, acc[g]);
              acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + 2 * u + 1]), odd, acc[g]);
            }
          }
        }
        for (int64_t g = 0; g < std::min(kHeadsAtOnce, group - g0); ++g)
          _mm512_mask_storeu_ps(out + (g0 + g) * len + t0, lanes, acc[g]);
      }
    }
    t = end;
  }
}

// The most dimensions summed at once that divide D, in at most four registers.
constexpr int64_t dims_at_once(int64_t d) {
  for (int64_t r = 4; r > 1; --r)
    if ((d / kLanes) % r == 0) return r * kLanes;
  return kLanes;
}

// acc[g] = sum_t p[g, t] * v[t] (p's rows padded to padded_group with zeros), a token's row loaded once for four
// query heads.
template <typename T, int64_t D>
void values_lanes(const float* p, const T* v_head, const int32_t* table, int64_t len, const Shape& s,
                  int64_t group, float* out) {
  constexpr int64_t kDims = dims_at_once(D), kRegs = kDims / kLanes;
  for (int64_t g0 = 0; g0 < group; g0 += kHeadsAtOnce)
    for (int64_t d0 = 0; d0 < D; d0 += kDims) {
      __m512 acc[kHeadsAtOnce][kRegs];
      for (auto& row : acc)
        for (auto& a : row) a = _mm512_setzero_ps();
      for_each_row(v_head, table, len, s, [&](int64_t t, const T* row) {
        __m512 v[kRegs];
        for (int64_t c = 0; c < kRegs; ++c) v[c] = pagedq::load16(row + d0 + c * kLanes);
        for (int64_t g = 0; g < kHeadsAtOnce; ++g) {
          const __m512 w = _mm512_set1_ps(p[(g0 + g) * len + t]);
          for (int64_t c = 0; c < kRegs; ++c) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
        }
      });
      for (int64_t g = 0; g < std::min(kHeadsAtOnce, group - g0); ++g)
        for (int64_t c = 0; c < kRegs; ++c) _mm512_storeu_ps(out + (g0 + g) * D + d0 + c * kLanes, acc[g][c]);
    }
}
#else
inline int64_t padded_group(int64_t group) { return group; }
#endif

#if defined(PAGEDQ_AMX)
// The AMX path (where pagedq::amx_fits). Scores: 16 keys' rows are an A tile as they sit in the block (no transpose),
// the queries' transpose the B tile, so a C tile holds 16 keys by the heads. Values: 32 tokens' rows are interleaved in
// pairs into B tiles (their columns are dimensions in the order the interleave leaves them), the softmax weights in
// bfloat16 the A tile, and the C tiles sum over the whole sequence in float32. Tiles of every thread are 16 rows of 64
// bytes; the scores use tiles 0-2, the values 0-1 (B), 3 (A) and 4-7 (C).
constexpr int64_t kTileRows = 16, kPairsPerRow = 16, kKeysAtOnce = 16, kTokensAtOnce = 32, kDimsAtOnce = 64;
constexpr int64_t kBlocksAhead = 2;
constexpr int kIntoL2 = 2;  // __builtin_prefetch's locality: prefetcht1

using pagedq::round_up;

struct AmxWork {
  alignas(64) uint32_t qt[8][kTileRows][kPairsPerRow];  // B tiles: row r of tile c, dims 32c + 2r and + 1, by head
  alignas(64) float scores[kTileRows][kPairsPerRow];     // one C tile of scores: keys by heads
  pagedq::ValueTiles values;                             // 32 tokens' values
  alignas(64) float sums[kTileRows][kDimsAtOnce];        // C tiles of weighted values: heads by dims
  std::vector<float> p;                                  // scores [group][len rounded up to 16]
  int64_t stride;                                        // of weights' rows: the longest sequence, rounded up
  std::vector<at::BFloat16> weights;                     // softmax weights [16][stride]; rows past the group zero
  explicit AmxWork(int64_t max_len) : stride(round_up(max_len, kTokensAtOnce)), weights(kTileRows * stride) {}
};

inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>((1u << std::min<int64_t>(n, kLanes)) - 1); }

// Raw scores q . k of the group's heads against keys [0, len) into w.p, and each head's lane-wise maximum.
template <int64_t D>
void amx_scores(const at::BFloat16* q_row, const at::BFloat16* k_head, const at::BFloat16* v_head,
                const int32_t* table, int64_t len, const Shape& s, int64_t group, AmxWork& w, __m512* top) {
  constexpr int64_t kChunks = D / 32;
  const auto* q_words = reinterpret_cast<const uint32_t*>(q_row);
  std::memset(w.qt, 0, sizeof(w.qt[0]) * kChunks);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t u = 0; u < D / 2; ++u) w.qt[u / kTileRows][u % kTileRows][g] = q_words[g * D / 2 + u];
  const int64_t token_stride = s.kv_heads * D, block_stride = s.block_size * token_stride, len16 = round_up(len, 16);
  w.p.resize(group * len16);
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(kPairsPerRow));
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < group; ++g) top[g] = none;
  // Keys kBlocksAhead blocks ahead, into L1; each block's values as its keys are scored, into L2, where the
  // values pass finds them (a sequence's values of one head are tens of KB). Without them the tiles wait on memory.
  const int64_t blocks = (len + s.block_size - 1) / s.block_size;
  const auto keys_of = [&](int64_t b) { return k_head + static_cast<int64_t>(table[b]) * block_stride; };
  for (int64_t b = 0; b < std::min(kBlocksAhead, blocks); ++b) prefetch_block(keys_of(b), len - b * s.block_size, s);
  for (int64_t t = 0, b = 0; t < len; ++b) {
    const at::BFloat16* block = keys_of(b);
    const int64_t end = std::min(len, t + s.block_size);
    const int64_t ahead = b + kBlocksAhead;
    if (ahead < blocks) prefetch_block(keys_of(ahead), len - ahead * s.block_size, s);
    prefetch_block<at::BFloat16, kIntoL2>(v_head + static_cast<int64_t>(table[b]) * block_stride, len - t, s);
    for (int64_t t0 = t; t0 < end; t0 += kKeysAtOnce) {
      // Rows past `end` are still this block's (unused lanes below).
      const at::BFloat16* keys = block + (t0 - t) * token_stride;
      _tile_zero(0);
      for (int64_t c = 0; c < kChunks; ++c) {
        _tile_loadd(1, keys + c * 32, token_stride * sizeof(at::BFloat16));
        _tile_loadd(2, w.qt[c], sizeof(w.qt[c][0]));
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, w.scores, sizeof(w.scores[0]));
      const __mmask16 valid = first_lanes(end - t0);
      for (int64_t g = 0; g < group; ++g) {
        const __m512 x = _mm512_mask_i32gather_ps(none, valid, _mm512_add_epi32(column, _mm512_set1_epi32(g)),
                                                  &w.scores[0][0], 4);
        _mm512_storeu_ps(w.p.data() + g * len16 + t0, x);
        top[g] = _mm512_max_ps(top[g], x);
      }
    }
    t = end;
  }
}

// The scores' softmax as bfloat16 weights (rows of w.weights, zeros to a multiple of 32 tokens), but for the
// division by each head's sum: inv[g] is 1 / sum, applied to the weighted values.
inline void amx_softmax(int64_t len, int64_t group, float scale, const __m512* top, AmxWork& w, float* inv) {
  const int64_t len16 = round_up(len, 16), len32 = round_up(len, kTokensAtOnce);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < group; ++g) {
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top[g]));
    const float* p = w.p.data() + g * len16;
    at::BFloat16* out = w.weights.data() + g * w.stride;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < len32; t0 += kLanes) {
      __m512 e = _mm512_setzero_ps();
      if (t0 < len)
        e = _mm512_maskz_mov_ps(first_lanes(len - t0),
                                pagedq::exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(p + t0), m), sc)));
      sum = _mm512_add_ps(sum, e);
      const __m256bh narrow = _mm512_cvtneps_pbh(e);
      std::memcpy(out + t0, &narrow, sizeof narrow);
    }
    inv[g] = 1.f / _mm512_reduce_add_ps(sum);
  }
}

// out[g] = inv[g] * sum_t weights[g, t] * v[t], 64 dimensions (or the last 32) at a time.
template <int64_t D>
void amx_values(const at::BFloat16* v_head, const int32_t* table, int64_t len, const Shape& s, int64_t group,
                const float* inv, AmxWork& w, at::BFloat16* o_row) {
  const int64_t token_stride = s.kv_heads * D, block_stride = s.block_size * token_stride;
  for (int64_t d0 = 0; d0 < D; d0 += kDimsAtOnce) {
    const bool wide = D - d0 >= kDimsAtOnce;  // else the last 32
    const auto row_of = [&](int64_t t) -> const at::BFloat16* {
      if (t >= len) return nullptr;
      const int64_t block = table[t / s.block_size];
      return v_head + block * block_stride + t % s.block_size * token_stride + d0;
    };
    pagedq::zero_sums();
    for (int64_t t0 = 0; t0 < len; t0 += kTokensAtOnce) {
      const at::BFloat16* first[2] = {row_of(t0), row_of(t0 + kKeysAtOnce)};
      w.values.pack(first, token_stride, len - t0, wide);
      _tile_loadd(3, w.weights.data() + t0, w.stride * sizeof(at::BFloat16));
      w.values.weigh(wide);
    }
    pagedq::store_sums(&w.sums[0][0], kDimsAtOnce);
    for (int64_t g = 0; g < group; ++g) pagedq::store_row(w.sums[g], inv[g], wide, o_row + g * D + d0);
  }
}

template <int64_t D>
void attend_amx(const at::BFloat16* q_row, const at::BFloat16* k_head, const at::BFloat16* v_head,
                const int32_t* table, int64_t len, const Shape& s, int64_t group, AmxWork& w, at::BFloat16* o_row) {
  __m512 top[kPairsPerRow];
  float inv[kPairsPerRow];
  amx_scores<D>(q_row, k_head, v_head, table, len, s, group, w, top);
  amx_softmax(len, group, s.scale, top, w, inv);
  amx_values<D>(v_head, table, len, s, group, inv, w, o_row);
}
#endif

// A thread's scratch: float rows for the AVX-512 and plain paths, tiles' buffers where it runs on AMX.
struct Work {
  std::vector<float> floats;
#if defined(PAGEDQ_AMX)
  std::unique_ptr<AmxWork> amx;
#endif
};

// One (sequence, KV head): its `group` query heads attend to the sequence's keys and values.
template <typename T, int64_t D>
void attend(const T* q_row, const T* k_head, const T* v_head, const int32_t* table, int64_t len, const Shape& s,
            int64_t group, Work& scratch, T* o_row) {
#if defined(PAGEDQ_AMX)
  if constexpr (std::is_same_v<T, at::BFloat16> && D % 32 == 0) {
    if (scratch.amx) return attend_amx<D>(q_row, k_head, v_head, table, len, s, group, *scratch.amx, o_row);
  }
#endif
  std::vector<float>& work = scratch.floats;
  const int64_t rows = padded_group(group);
  work.assign(rows * D + group * D + group + rows * len, 0.f);  // padding rows of queries and weights stay zeros
  float *qf = work.data(), *acc = qf + rows * D, *inv = acc + group * D, *p = inv + group;
  for (int64_t j = 0; j < group * D; ++j) qf[j] = static_cast<float>(q_row[j]) * s.scale;
#if defined(__AVX512F__)
  if constexpr (kLanePath<T>) {
    scores_lanes<T, D>(qf, k_head, table, len, s, group, p);
    softmax_rows(p, group, len, inv);
    values_lanes<T, D>(p, v_head, table, len, s, group, acc);
  } else
#endif
  {
    scores<T, D>(qf, k_head, table, len, s, group, p);
    softmax_rows(p, group, len, inv);
    weighted_values<T, D>(p, v_head, table, len, s, group, acc);
  }
  for (int64_t j = 0; j < group * D; ++j) o_row[j] = static_cast<T>(acc[j] * inv[j / D]);
}

using pagedq::kHeadSizes;

template <typename T, size_t I = 0>
void attend_any(const T* q_row, const T* k_head, const T* v_head, const int32_t* table, int64_t len,
                const Shape& s, int64_t group, Work& work, T* o_row) {
  if constexpr (I < std::size(kHeadSizes)) {
    if (s.head_dim == kHeadSizes[I]) {
      attend<T, kHeadSizes[I]>(q_row, k_head, v_head, table, len, s, group, work, o_row);
    } else {
      attend_any<T, I + 1>(q_row, k_head, v_head, table, len, s, group, work, o_row);
    }
  }
}

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* rows,
            const int64_t* seqs, const int32_t* lens, const int32_t* tables, const Shape& s, int64_t n,
            at::Tensor& out) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t group = s.q_heads / s.kv_heads;
  // A work item is a sequence, its KV heads one after the other, each thread's items of about equal cost.
  std::vector<int64_t> costs(n);
  for (int64_t i = 0; i < n; ++i) costs[i] = lens[seqs[i]] + 1;
  const auto bins = pagedq::balance(costs, at::get_num_threads());
  auto attend_seq = [&](int64_t i, Work& work) {
    const int64_t len = lens[seqs[i]];
    const int32_t* table = tables + seqs[i] * s.table_stride;
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      const int64_t row = (rows[i] * s.q_heads + h * group) * s.head_dim;
      if (len == 0) {  // a padding row of a padded batch sees no key: zeros
        std::fill(op + row, op + row + group * s.head_dim, T(0));
      } else {
        attend_any<T>(qp + row, kp + h * s.head_dim, vp + h * s.head_dim, table, len, s, group, work, op + row);
      }
    }
  };
#if defined(PAGEDQ_AMX)
  const bool amx = pagedq::amx_fits(std::is_same_v<T, at::BFloat16>, s.head_dim, s.block_size, group);
  const int64_t max_len = n ? *std::max_element(costs.begin(), costs.end()) : 0;
#endif
  at::parallel_for(0, static_cast<int64_t>(bins.size()), 1, [&](int64_t begin, int64_t end) {
    Work work;
#if defined(PAGEDQ_AMX)
    std::optional<pagedq::Tiles> tiles;
    if (amx) {
      tiles.emplace();
      work.amx = std::make_unique<AmxWork>(max_len);
    }
#endif
    for (int64_t bin = begin; bin < end; ++bin)
      for (const int64_t i : bins[bin]) attend_seq(i, work);
  });
}

}  // namespace

namespace pagedq {

void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& rows, const at::Tensor& seqs, const at::Tensor& seq_lens,
                      const at::Tensor& block_table, double scale, at::Tensor out) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decode_attention: q, out and the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "decode_attention: q, out and the caches must share a dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && seqs.scalar_type() == at::kLong, "rows and seqs are int64");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && block_table.scalar_type() == at::kInt,
              "seq_lens and block_table are int32");
  TORCH_CHECK(block_table.is_contiguous() && seq_lens.is_contiguous() && rows.is_contiguous() && seqs.is_contiguous(),
              "decode_attention: the index tensors must be contiguous");
  const Shape s{q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), block_table.size(1),
                static_cast<float>(scale)};
  TORCH_CHECK(s.q_heads % s.kv_heads == 0 && k_cache.size(3) == s.head_dim, "decode_attention: head shapes");
  const auto sizes = pagedq::head_sizes();
  TORCH_CHECK(std::find(sizes.begin(), sizes.end(), s.head_dim) != sizes.end(), "decode_attention: head size ",
              s.head_dim, " is not built");
  const int64_t n = rows.numel();
  // Cheap bounds (per row, not per block): a kernel that reads memory by index must not read past its tensors.
  TORCH_CHECK(seqs.numel() == n, "decode_attention: a sequence per row");
  const int64_t *row_p = rows.data_ptr<int64_t>(), *seq_p = seqs.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(row_p[i] >= 0 && row_p[i] < q.size(0) && seq_p[i] >= 0 && seq_p[i] < block_table.size(0) &&
                    seq_p[i] < seq_lens.numel(),
                "decode_attention: row or sequence out of range");
    const int64_t len = seq_lens.data_ptr<int32_t>()[seq_p[i]];
    TORCH_CHECK(len >= 0 && len <= s.table_stride * s.block_size, "decode_attention: sequence ", seq_p[i],
                " holds ", len, " tokens, more than its block table row");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    decode<scalar_t>(q, k_cache, v_cache, rows.data_ptr<int64_t>(), seqs.data_ptr<int64_t>(),
                     seq_lens.data_ptr<int32_t>(), block_table.data_ptr<int32_t>(), s, n, out);
  });
}

// k, v [T, Hkv, D] (each token's heads contiguous, any token stride) copied into the caches at flat slots
// (block * block_size + offset); slot -1 is skipped. One memcpy per token and cache, where index_copy_ goes
// element by element.
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes(), "store_kv: k and v are [T, Hkv, D]");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "store_kv: each token's heads contiguous");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "store_kv: contiguous caches of k's and v's dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "store_kv: int64 slots");
  TORCH_CHECK(k_cache.size(2) * k_cache.size(3) == k.size(1) * k.size(2), "store_kv: head shapes");
  const int64_t tokens = k.size(0), row_bytes = k.size(1) * k.size(2) * k.element_size();
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const char *kp = static_cast<const char*>(k.data_ptr()), *vp = static_cast<const char*>(v.data_ptr());
  char *kc = static_cast<char*>(k_cache.data_ptr()), *vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size(), v_stride = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slot[t] < slots, "store_kv: slot ", slot[t], " out of range");
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;
      std::memcpy(kc + slot[t] * row_bytes, kp + t * k_stride, row_bytes);
      std::memcpy(vc + slot[t] * row_bytes, vp + t * v_stride, row_bytes);
    }
  });
}

// Whole blocks within the cache [2, layers, blocks, ...]: block pairs[0][i] into pairs[1][i], keys and values of
// every layer (a block forked continuations share, copied before one of them writes into it).
void copy_blocks(at::Tensor kv_cache, const at::Tensor& pairs) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() >= 3, "copy_blocks: a contiguous [2, layers, blocks, ...] cache");
  TORCH_CHECK(pairs.scalar_type() == at::kLong && pairs.dim() == 2 && pairs.size(0) == 2 && pairs.is_contiguous(),
              "copy_blocks: int64 pairs [2, P]");
  const int64_t planes = kv_cache.size(0) * kv_cache.size(1), blocks = kv_cache.size(2), n = pairs.size(1);
  const int64_t bytes = kv_cache.stride(2) * kv_cache.element_size();
  const int64_t* src = pairs.data_ptr<int64_t>();
  const int64_t* dst = src + n;
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(src[i] >= 0 && src[i] < blocks && dst[i] >= 0 && dst[i] < blocks, "copy_blocks: block out of range");
  char* base = static_cast<char*>(kv_cache.data_ptr());
  at::parallel_for(0, planes * n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      char* plane = base + (j / n) * blocks * bytes;
      std::memcpy(plane + dst[j % n] * bytes, plane + src[j % n] * bytes, bytes);
    }
  });
}

std::vector<int64_t> head_sizes() { return {std::begin(kHeadSizes), std::end(kHeadSizes)}; }

bool decode_uses_amx() {
#if defined(PAGEDQ_AMX)
  return amx_ready();
#else
  return false;
#endif
}

}  // namespace pagedq

TORCH_LIBRARY_IMPL(pagedq, CPU, m) {
  m.impl("decode_attention", &pagedq::decode_attention);
  m.impl("store_kv", &pagedq::store_kv);
  m.impl("copy_blocks", &pagedq::copy_blocks);
}
