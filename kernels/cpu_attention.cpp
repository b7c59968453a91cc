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

#include "cpu_math.h"

#include <immintrin.h>

#include <algorithm>
#include <iterator>
#include <cmath>
#include <cstring>
#include <limits>
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

// Calls f(t, row) for the rows of tokens [0, len) of one head, block by block: no division per token.
template <typename T, typename F>
inline void for_each_row(const T* head, const int32_t* table, int64_t len, const Shape& s, F f) {
  const int64_t token_stride = s.kv_heads * s.head_dim, block_stride = s.block_size * token_stride;
  const int64_t row_bytes = s.head_dim * static_cast<int64_t>(sizeof(T));
  for (int64_t t = 0, b = 0; t < len; ++b) {
    const T* row = head + static_cast<int64_t>(table[b]) * block_stride;
    const int64_t end = std::min(len, t + s.block_size);
    if (end < len) {  // the next block is elsewhere in memory, where the hardware prefetcher cannot guess
      const char* next = reinterpret_cast<const char*>(head + static_cast<int64_t>(table[b + 1]) * block_stride);
      for (int64_t o = 0; o < std::min(s.block_size, len - end); ++o)
        for (int64_t c = 0; c < row_bytes; c += 64) __builtin_prefetch(next + o * token_stride * sizeof(T) + c);
    }
    for (; t < end; ++t, row += token_stride) f(t, row);
  }
}

#if defined(__AVX512BF16__)
// The AVX-512 BF16 paths: bfloat16 rows of whole 512-bit registers, and at most this many query heads per KV head
// (their accumulators stay in registers).
constexpr int64_t kBf16MaxGroup = 4;
template <typename T, int64_t D>
constexpr bool kBf16Dots = std::is_same_v<T, at::BFloat16> && D % 32 == 0;

// bfloat16 keys on a CPU with AVX-512 BF16: each pair of bfloat16 products is summed into float32 in one
// instruction, against the query's own bfloat16 values (the scale is applied to the float32 score).
template <int64_t D>
void scores_bf16(const at::BFloat16* q_row, float scale, const at::BFloat16* k_head, const int32_t* table,
                 int64_t len, const Shape& s, int64_t group, float* out) {
  constexpr int64_t kLanes = 32;  // bfloat16 values in a 512-bit register
  __m512bh q[kBf16MaxGroup][D / kLanes];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < D / kLanes; ++c)
      q[g][c] = (__m512bh)_mm512_loadu_si512(q_row + g * D + c * kLanes);
  for_each_row(k_head, table, len, s, [&](int64_t t, const at::BFloat16* row) {
    __m512bh k[D / kLanes];
    for (int64_t c = 0; c < D / kLanes; ++c) k[c] = (__m512bh)_mm512_loadu_si512(row + c * kLanes);
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < D / kLanes; ++c) acc = _mm512_dpbf16_ps(acc, q[g][c], k[c]);
      out[g * len + t] = _mm512_reduce_add_ps(acc) * scale;
    }
  });
}
#endif

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

// Scores by the fastest path this CPU has for T.
template <typename T, int64_t D>
void scores_any(const T* q_row, const float* qf, const T* k_head, const int32_t* table, int64_t len,
                const Shape& s, int64_t group, float* out) {
#if defined(__AVX512BF16__)
  if constexpr (kBf16Dots<T, D>) {
    if (group <= kBf16MaxGroup) {
      scores_bf16<D>(q_row, s.scale, k_head, table, len, s, group, out);
      return;
    }
  }
#endif
  scores<T, D>(qf, k_head, table, len, s, group, out);
}

// Softmax of each query's row in place.
inline void softmax_rows(float* p, int64_t rows, int64_t len) {
  for (int64_t g = 0; g < rows; ++g) {
    float* r = p + g * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) m = std::max(m, r[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      r[t] = pagedq::fast_exp(r[t] - m);
      sum += r[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) r[t] *= inv;
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

#if defined(__AVX512BF16__)
// bfloat16 values on a CPU with AVX-512 BF16: two tokens at a time, their rows interleaved into (v_t, v_t+1)
// pairs and their weights rounded to bfloat16 (as torch's fused CPU attention rounds them for this product), so
// one instruction adds both products of a pair into float32. The interleave works within 128-bit lanes, which
// leaves the accumulators' dimensions permuted: they are put back in order once, at the end.
template <int64_t D>
void weighted_values_bf16(const float* p, const at::BFloat16* v_head, const int32_t* table, int64_t len,
                          const Shape& s, int64_t group, float* acc) {
  constexpr int64_t kLanes = 32, C = D / kLanes;
  __m512 lo[kBf16MaxGroup][C], hi[kBf16MaxGroup][C];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < C; ++c) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
  auto add_pair = [&](int64_t t, const at::BFloat16* a, const at::BFloat16* b, bool both) {
    __m512bh pairs_lo[C], pairs_hi[C];
    for (int64_t c = 0; c < C; ++c) {
      const __m512i x = _mm512_loadu_si512(a + c * kLanes), y = _mm512_loadu_si512(b + c * kLanes);
      pairs_lo[c] = (__m512bh)_mm512_unpacklo_epi16(x, y);
      pairs_hi[c] = (__m512bh)_mm512_unpackhi_epi16(x, y);
    }
    for (int64_t g = 0; g < group; ++g) {
      const uint32_t w0 = at::BFloat16(p[g * len + t]).x;
      const uint32_t w1 = both ? at::BFloat16(p[g * len + t + 1]).x : 0;
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(w0 | (w1 << 16)));
      for (int64_t c = 0; c < C; ++c) {
        lo[g][c] = _mm512_dpbf16_ps(lo[g][c], pairs_lo[c], w);
        hi[g][c] = _mm512_dpbf16_ps(hi[g][c], pairs_hi[c], w);
      }
    }
  };
  const at::BFloat16* pending = nullptr;
  int64_t pending_t = 0;
  for_each_row(v_head, table, len, s, [&](int64_t t, const at::BFloat16* row) {
    if (pending == nullptr) {
      pending = row;
      pending_t = t;
    } else {
      add_pair(pending_t, pending, row, true);
      pending = nullptr;
    }
  });
  if (pending != nullptr) add_pair(pending_t, pending, pending, false);  // an odd last row, paired at weight 0
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t c = 0; c < C; ++c) {
      float l[16], h[16];
      _mm512_storeu_ps(l, lo[g][c]);
      _mm512_storeu_ps(h, hi[g][c]);
      for (int64_t i = 0; i < 16; ++i) {  // lane i of 128-bit lane i / 4 holds dimension 8 * (i / 4) + i % 4 (+4)
        acc[g * D + c * kLanes + 8 * (i / 4) + i % 4] = l[i];
        acc[g * D + c * kLanes + 8 * (i / 4) + 4 + i % 4] = h[i];
      }
    }
  }
}
#endif

// Weighted values by the fastest path this CPU has for T.
template <typename T, int64_t D>
void weighted_values_any(const float* p, const T* v_head, const int32_t* table, int64_t len, const Shape& s,
                         int64_t group, float* acc) {
#if defined(__AVX512BF16__)
  if constexpr (kBf16Dots<T, D>) {
    if (group <= kBf16MaxGroup) {
      weighted_values_bf16<D>(p, v_head, table, len, s, group, acc);
      return;
    }
  }
#endif
  weighted_values<T, D>(p, v_head, table, len, s, group, acc);
}

// One (sequence, KV head): its `group` query heads attend to the sequence's keys and values.
template <typename T, int64_t D>
void attend(const T* q_row, const T* k_head, const T* v_head, const int32_t* table, int64_t len, const Shape& s,
            int64_t group, std::vector<float>& work, T* o_row) {
  work.resize(2 * group * D + group * len);
  float *qf = work.data(), *acc = qf + group * D, *p = acc + group * D;
  for (int64_t j = 0; j < group * D; ++j) qf[j] = static_cast<float>(q_row[j]) * s.scale;
  scores_any<T, D>(q_row, qf, k_head, table, len, s, group, p);
  softmax_rows(p, group, len);
  weighted_values_any<T, D>(p, v_head, table, len, s, group, acc);
  for (int64_t j = 0; j < group * D; ++j) o_row[j] = static_cast<T>(acc[j]);
}

// The head sizes the kernel is built for: the compiler knows D, so the loops over it unroll and vectorize.
constexpr int64_t kHeadSizes[] = {16, 32, 64, 80, 96, 128, 256};

template <typename T, size_t I = 0>
void attend_any(const T* q_row, const T* k_head, const T* v_head, const int32_t* table, int64_t len,
                const Shape& s, int64_t group, std::vector<float>& work, T* o_row) {
  if constexpr (I < std::size(kHeadSizes)) {
    if (s.head_dim == kHeadSizes[I]) {
      attend<T, kHeadSizes[I]>(q_row, k_head, v_head, table, len, s, group, work, o_row);
    } else {
      attend_any<T, I + 1>(q_row, k_head, v_head, table, len, s, group, work, o_row);
    }
  }
}

std::vector<int64_t> head_sizes() { return {std::begin(kHeadSizes), std::end(kHeadSizes)}; }

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* rows,
            const int64_t* seqs, const int32_t* lens, const int32_t* tables, const Shape& s, int64_t n,
            at::Tensor& out) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t group = s.q_heads / s.kv_heads;
  // A work item is a sequence, its KV heads one after the other: the first head streams the sequence's blocks
  // through the cache whole (a token's heads are adjacent), the others find them there.
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work;
    for (int64_t i = begin; i < end; ++i) {
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
    }
  });
}

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
  const auto sizes = head_sizes();
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

}  // namespace

TORCH_LIBRARY(pagedq, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor rows, Tensor seqs, Tensor seq_lens, "
        "Tensor block_table, float scale, Tensor(a!) out) -> ()");
  m.def("head_sizes() -> int[]", &head_sizes);
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedq, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("store_kv", &store_kv);
}
