// A Llama-family decoder stack run in C++ on the CPU kernels: one call a step in place of a few hundred op calls
// from Python (kernels/cpu_model.cpp). Registered as torch.classes.pagedq.Decoder in cpu_library.cpp.
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <optional>
#include <vector>

namespace pagedq {

class Decoder : public torch::CustomClassHolder {
 public:
  // Per layer, kTensorsPerLayer tensors: the input and post-attention norms' weights; the packed qkv, o, gate_up
  // and down weights, each followed by its float32 bias; the q and k norms' weights (Qwen3); the layer's K and V
  // caches (an absent bias or norm: a tensor of no elements). Then the embedding, the final norm's weight and the
  // rotary tables (float32 cos, sin [positions, head_dim]). dims: hidden, query heads, KV heads, head dim,
  // intermediate size, gated (1: gate_up returns silu(gate) * up). eps: the norms'; scale: attention's.
  Decoder(std::vector<at::Tensor> tensors, std::vector<int64_t> dims, double eps, double scale);

  // The final norm's output [T, hidden] for a flat batch of tokens: input_ids, positions (int64) and slot_mapping
  // [T]; query_start_loc (int64) [B + 1], seq_lens and block_table (int32); the decode rows and sequences and the
  // prefilling sequences (int64), as kernels/cpu_ops.py plans them.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table,
                     const at::Tensor& decode_rows, const at::Tensor& decode_seqs, const at::Tensor& prefill_seqs);

  static constexpr int64_t kTensorsPerLayer = 14;

 private:
  struct Layer {
    at::Tensor input_norm, post_norm, qkv, o, gate_up, down, k_cache, v_cache;
    std::optional<at::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias, q_norm, k_norm;
  };
  struct Step;

  at::Tensor attention(const Layer& layer, const at::Tensor& x, const Step& step) const;
  at::Tensor mlp(const Layer& layer, const at::Tensor& x) const;

  std::vector<Layer> layers_;
  at::Tensor embed_, norm_, cos_, sin_;
  int64_t hidden_, q_heads_, kv_heads_, head_dim_, inter_;
  bool gated_;
  double eps_, scale_;
};

}  // namespace pagedq
