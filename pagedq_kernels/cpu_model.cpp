// The decoder stack of kernels/cpu_model.h: the same kernels, in the same order, with the same roundings as the
// Python model (engine/models/llama.py) on the CPU backend, so its outputs equal that path's. What it saves is
// Python: a 30-layer forward of one token made ~400 op calls from Python, ~5 ms a step on a 2-core EPYC, which at
// batch 1 was as long as reading the bfloat16 weights.

#include "cpu_model.h"

#include "cpu_library.h"

namespace pagedq {

namespace {

std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.numel() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// RMSNorm of each head's row of x [T, H, D] (Qwen3's q/k norms): a new contiguous tensor, as the Python model's.
at::Tensor norm_heads(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor rows = x.reshape({-1, x.size(2)});
  at::Tensor out = at::empty(rows.sizes(), x.options());
  rms_norm(rows, weight, eps, out);
  return out.view(x.sizes());
}

}  // namespace

struct Decoder::Step {
  const at::Tensor &positions, &slot_mapping, &query_start_loc, &seq_lens, &block_table, &decode_rows, &decode_seqs,
      &prefill_seqs;
};

Decoder::Decoder(std::vector<at::Tensor> tensors, std::vector<int64_t> dims, double eps, double scale)
    : eps_(eps), scale_(scale) {
  TORCH_CHECK(dims.size() == 6, "Decoder: dims are hidden, q_heads, kv_heads, head_dim, inter, gated");
  hidden_ = dims[0], q_heads_ = dims[1], kv_heads_ = dims[2], head_dim_ = dims[3], inter_ = dims[4];
  gated_ = dims[5] != 0;
  const auto n = static_cast<int64_t>(tensors.size()) - 4;
  TORCH_CHECK(n > 0 && n % kTensorsPerLayer == 0, "Decoder: ", kTensorsPerLayer, " tensors a layer, then 4");
  for (int64_t i = 0; i < n; i += kTensorsPerLayer) {
    const auto* t = tensors.data() + i;
    layers_.push_back(Layer{t[0], t[1], t[2], t[4], t[6], t[8], t[12], t[13], present(t[3]), present(t[5]),
                            present(t[7]), present(t[9]), present(t[10]), present(t[11])});
  }
  embed_ = tensors[n], norm_ = tensors[n + 1], cos_ = tensors[n + 2], sin_ = tensors[n + 3];
}

at::Tensor Decoder::attention(const Layer& layer, const at::Tensor& x, const Step& step) const {
  const int64_t tokens = x.size(0), q_size = q_heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
  const at::Tensor qkv = panel_linear(x, layer.qkv, layer.qkv_bias, q_size + 2 * kv_size, false);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, q_heads_, head_dim_});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads_, head_dim_});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads_, head_dim_});
  if (layer.q_norm) {
    q = norm_heads(q, *layer.q_norm, eps_);
    k = norm_heads(k, *layer.k_norm, eps_);
  }
  rotary(q, step.positions, cos_, sin_);
  rotary(k, step.positions, cos_, sin_);
  store_kv(k, v, layer.k_cache, layer.v_cache, step.slot_mapping);
  const at::Tensor queries = q.contiguous();
  at::Tensor out = at::empty_like(queries);
  if (step.decode_rows.numel())
    decode_attention(queries, layer.k_cache, layer.v_cache, step.decode_rows, step.decode_seqs, step.seq_lens,
                     step.block_table, scale_, out);
  if (step.prefill_seqs.numel())
    prefill_attention(queries, layer.k_cache, layer.v_cache, step.prefill_seqs, step.query_start_loc, step.seq_lens,
                      step.block_table, scale_, out);
  return panel_linear(out.view({tokens, q_size}), layer.o, layer.o_bias, hidden_, false);
}

at::Tensor Decoder::mlp(const Layer& layer, const at::Tensor& x) const {
  if (gated_) return panel_linear(panel_linear(x, layer.gate_up, std::nullopt, 2 * inter_, true), layer.down,
                                  layer.down_bias, hidden_, false);
  const at::Tensor both = panel_linear(x, layer.gate_up, layer.gate_up_bias, 2 * inter_, false);
  at::Tensor act;
  if (both.scalar_type() == at::kBFloat16 && inter_ % 16 == 0 && silu_and_mul_built()) {
    act = at::empty({both.size(0), inter_}, both.options());
    silu_and_mul(both, act);
  } else {  // torch's own SiLU and product, as the Python model's float32 path
    act = at::silu(both.narrow(1, 0, inter_)) * both.narrow(1, inter_, inter_);
  }
  return panel_linear(act, layer.down, layer.down_bias, hidden_, false);
}

at::Tensor Decoder::forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                            const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                            const at::Tensor& block_table, const at::Tensor& decode_rows,
                            const at::Tensor& decode_seqs, const at::Tensor& prefill_seqs) {
  const Step step{positions, slot_mapping, query_start_loc, seq_lens, block_table, decode_rows, decode_seqs,
                  prefill_seqs};
  at::Tensor h = at::embedding(embed_, input_ids), residual;
  for (const Layer& layer : layers_) {
    at::Tensor x = at::empty_like(h);
    if (!residual.defined()) {
      residual = h;
      rms_norm(h, layer.input_norm, eps_, x);
    } else {
      add_rms_norm(h, residual, layer.input_norm, eps_, x);
    }
    const at::Tensor attended = attention(layer, x, step);
    at::Tensor y = at::empty_like(attended);
    add_rms_norm(attended, residual, layer.post_norm, eps_, y);
    h = mlp(layer, y);
  }
  at::Tensor out = at::empty_like(h);
  add_rms_norm(h, residual, norm_, eps_, out);
  return out;
}

}  // namespace pagedq
