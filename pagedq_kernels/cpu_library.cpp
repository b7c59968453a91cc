// The torch library of the CPU kernels: every op's schema in one place (torch.ops.pagedq.*), and the Decoder class
// (torch.classes.pagedq.Decoder). Each kernel file registers its CPU implementations; the queries here take no
// tensor, so they are registered with their schemas.

#include <torch/library.h>

#include "cpu_library.h"
#include "cpu_model.h"

TORCH_LIBRARY(pagedq, m) {
  m.def("head_sizes() -> int[]", &pagedq::head_sizes);
  m.def("decode_uses_amx() -> bool", &pagedq::decode_uses_amx);
  m.def("prefill_max_group() -> int", &pagedq::prefill_max_group);
  m.def("silu_and_mul_built() -> bool", &pagedq::silu_and_mul_built);
  m.def("panel_linear_path(str dtype) -> str", &pagedq::panel_linear_path);
  m.def("quant_linear_path() -> str", &pagedq::quant_linear_path);

  // cpu_attention.cpp
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor rows, Tensor seqs, Tensor seq_lens, "
        "Tensor block_table, float scale, Tensor(a!) out) -> ()");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("copy_blocks(Tensor(a!) kv_cache, Tensor pairs) -> ()");
  // cpu_prefill.cpp
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seqs, Tensor query_start_loc, "
        "Tensor seq_lens, Tensor block_table, float scale, Tensor(a!) out) -> ()");
  // cpu_layers.cpp
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps, Tensor(b!) out) -> ()");
  m.def("rotary(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  // cpu_sampling.cpp
  m.def("argmax_rows(Tensor logits) -> Tensor");
  // cpu_linear.cpp
  m.def("panel_pack(Tensor w, int gate_rows) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor packed, Tensor? bias, int n, bool gated) -> Tensor");
  m.def("panel_linear_out(Tensor x, Tensor packed, Tensor? bias, int n, bool gated, Tensor(a!) out) -> ()");
  // cpu_model.cpp
  m.class_<pagedq::Decoder>("Decoder")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, double, double>())
      .def("forward", &pagedq::Decoder::forward);
}
