// The CPU kernels' entry points: each registered as an op in cpu_library.cpp (torch.ops.pagedq.*), and callable from
// C++ too (cpu_model.cpp runs a whole forward on them). Each is defined beside the kernels it runs; the queries say
// what a build can do, asked once from Python (kernels/cpu_ops.py).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pagedq {

// cpu_attention.cpp
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& rows, const at::Tensor& seqs, const at::Tensor& seq_lens,
                      const at::Tensor& block_table, double scale, at::Tensor out);
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping);
void copy_blocks(at::Tensor kv_cache, const at::Tensor& pairs);
std::vector<int64_t> head_sizes();  // the head sizes decode and prefill attention are built for
bool decode_uses_amx();             // bfloat16 decodes run on AMX tiles here

// cpu_prefill.cpp
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& seqs, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                       const at::Tensor& block_table, double scale, at::Tensor out);
int64_t prefill_max_group();  // most query heads per KV head; 0 where there is no kernel

// cpu_layers.cpp
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out);
void add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps, at::Tensor out);
void rotary(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
void silu_and_mul(const at::Tensor& x, at::Tensor out);
bool silu_and_mul_built();  // the bfloat16 SiLU-and-multiply pass is built

// cpu_sampling.cpp
at::Tensor argmax_rows(const at::Tensor& logits);

// cpu_linear.cpp
at::Tensor panel_pack(const at::Tensor& w, int64_t gate_rows);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
                        bool gated);
void panel_linear_out(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
                      bool gated, at::Tensor out);
// How panel_linear multiplies a dtype's weights here ("amx", "avx512_bf16", "avx512"); "" where it cannot.
std::string panel_linear_path(const std::string& dtype);

// cpu_quant.cpp: x @ w.T (+ bias), or silu(gate) * up when gated, for weights kept quantized in its layout
// (kernels/quant_layout.py), uint8 [ceil(N / 16), bytes a panel]; panel_linear_out hands such weights here.
void quant_linear_out(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
                      bool gated, at::Tensor out);
std::string quant_linear_path();  // "avx512_vnni", "avx_vnni", "avx2", or "" where it is not built

}  // namespace pagedq
