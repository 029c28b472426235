// The compiled CPU ops as C++ functions, for ops that chain them without going back through Python
// (decode_layers.cpp). Each is exactly what torch.ops.pagedserve.<name> runs on a CPU tensor.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace pagedserve_cpu {

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype, int64_t in_features);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                                                    const at::Tensor& key, const at::Tensor& cos_sin_cache,
                                                    int64_t head_size, bool is_neox);
at::Tensor silu_and_mul(const at::Tensor& x);
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                       const at::Tensor& slot_mapping);
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t sliding_window);

}  // namespace pagedserve_cpu
