// The schemas of torch.ops.pagedserve.*; each op's CPU implementation registers itself in its own file.
// Built on first use by kernels/cpu/build.py.

#include <torch/library.h>

TORCH_LIBRARY(pagedserve, m) {
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int sliding_window) -> Tensor");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
  m.def("gguf_linear(Tensor x, Tensor weight, int qtype, int in_features) -> Tensor");
  m.def("gguf_embedding(Tensor ids, Tensor weight, int qtype, int dim, ScalarType dtype) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_embedding(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, int head_size, "
        "bool is_neox) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("greedy_argmax(Tensor logits) -> Tensor");
  m.def("decode_layers(Tensor hidden, Tensor? residual, Tensor positions, Tensor?[] params, int[] qtypes, "
        "int[] in_features, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor cos_sin_cache, int num_heads, int num_kv_heads, "
        "int head_size, bool is_neox, float scale, int[] sliding_windows, float eps) -> (Tensor, Tensor)");
}
