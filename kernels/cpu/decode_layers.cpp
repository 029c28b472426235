// A decode step through a stack of Llama-family decoder layers in one op (the CPU counterpart of a CUDA
// graph of the decode forward).
//
// A batch-1 decode step of a 30-layer model is about 330 op calls from Python (norms, projections,
// rotary, cache write, attention, activation): at a few microseconds of Python and dispatch each, more
// than the arithmetic of every op but the projections. Here the same ops run back to back in C++: the
// functions each torch.ops.pagedserve.* op runs (ops.h) and at::linear / add for float weights, called
// with the same tensors in the same order as engine/models/llama.py's layers call them, so the result is
// the module path's bit for bit. Only pure decode batches come here (one query token per sequence, every
// row a sequence); the model keeps its module path for everything else.
//
// torch.ops.pagedserve.decode_layers (schema in registration.cpp). Per layer, `params` holds
// kParamsPerLayer tensors in the order of `Param` (absent ones as None), `qtypes` and `in_features` hold
// one entry per projection in the order of `Proj` (qtype -1: a float weight).

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

enum Param : int64_t {
  kInputNorm, kQKV, kQKVBias, kQNorm, kKNorm, kO, kOBias, kPostNorm, kGateUp, kGateUpBias, kDown, kDownBias,
  kParamsPerLayer
};
enum Proj : int64_t { kProjQKV, kProjO, kProjGateUp, kProjDown, kProjsPerLayer };

using OptionalTensors = c10::List<c10::optional<at::Tensor>>;

// A stage of a layer as a torch.profiler scope (a flag check when no profiler runs).
#define STAGE(name) RECORD_FUNCTION(name, std::vector<c10::IValue>())

struct Layer {
  const OptionalTensors& params;
  int64_t first;  // index of this layer's first parameter
  const int64_t* qtypes;
  const int64_t* in_features;

  bool has(Param p) const { return params.get(first + p).has_value(); }
  at::Tensor get(Param p) const { return *params.get(first + p); }

  // x W^T without the bias: at::linear for a float weight (F.linear), the GGUF kernel for a quantized one.
  at::Tensor matmul(const at::Tensor& x, Param weight, Proj proj) const {
    if (qtypes[proj] < 0) return at::linear(x, get(weight));
    return pagedserve_cpu::gguf_linear(x, get(weight), qtypes[proj], in_features[proj]);
  }

  // A column-parallel projection (ColumnParallelLinear.forward at TP 1): F.linear(x, W, b) for a float
  // weight (the bias inside the matmul), the quantized matmul plus b for a quantized one.
  at::Tensor column(const at::Tensor& x, Param weight, Param bias, Proj proj) const {
    if (qtypes[proj] < 0) return has(bias) ? at::linear(x, get(weight), get(bias)) : at::linear(x, get(weight));
    at::Tensor y = matmul(x, weight, proj);
    return has(bias) ? y + get(bias) : y;
  }

  // A row-parallel projection (RowParallelLinear.forward at TP 1): the matmul, then the bias added.
  at::Tensor row(const at::Tensor& x, Param weight, Param bias, Proj proj) const {
    at::Tensor y = matmul(x, weight, proj);
    return has(bias) ? y + get(bias) : y;
  }
};

std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden_in, const c10::optional<at::Tensor>& residual_in, const at::Tensor& positions,
    const OptionalTensors& params, at::IntArrayRef qtypes, at::IntArrayRef in_features,
    at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cos_sin_cache, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_size, bool is_neox, double scale, at::IntArrayRef sliding_windows,
    double eps) {
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(hidden_in.device().is_cpu() && hidden_in.dim() == 2, "decode_layers (CPU op): hidden [T, hidden] expected");
  TORCH_CHECK(num_layers > 0 && static_cast<int64_t>(value_caches.size()) == num_layers &&
                  static_cast<int64_t>(params.size()) == num_layers * kParamsPerLayer &&
                  static_cast<int64_t>(qtypes.size()) == num_layers * kProjsPerLayer &&
                  static_cast<int64_t>(in_features.size()) == num_layers * kProjsPerLayer &&
                  static_cast<int64_t>(sliding_windows.size()) == num_layers,
              "decode_layers: per-layer lists of inconsistent lengths");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_size > 0, "decode_layers: head counts must be positive");
  const int64_t tokens = hidden_in.size(0);
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == tokens,
              "decode_layers: one query token per sequence expected (seq_lens [T])");
  const int64_t q_size = num_heads * head_size, kv_size = num_kv_heads * head_size;

  at::Tensor hidden = hidden_in, residual;
  bool have_residual = residual_in.has_value();
  if (have_residual) residual = *residual_in;
  for (int64_t i = 0; i < num_layers; ++i) {
    const Layer layer{params, i * kParamsPerLayer, qtypes.data() + i * kProjsPerLayer,
                      in_features.data() + i * kProjsPerLayer};
    for (const Param p : {kInputNorm, kQKV, kO, kPostNorm, kGateUp, kDown})
      TORCH_CHECK(layer.has(p), "decode_layers: layer ", i, " is missing parameter ", static_cast<int64_t>(p));
    // DecoderLayer.forward: input norm (with the residual add after the first layer of the model).
    {
      STAGE("decode_layers/input_norm");
      if (have_residual) {
        std::tie(hidden, residual) = pagedserve_cpu::fused_add_rms_norm(hidden, residual, layer.get(kInputNorm), eps);
      } else {
        residual = hidden;
        hidden = pagedserve_cpu::rms_norm(hidden, layer.get(kInputNorm), eps);
        have_residual = true;
      }
    }
    // DecoderAttention.forward.
    at::Tensor qkv;
    {
      STAGE("decode_layers/qkv_proj");
      qkv = layer.column(hidden, kQKV, kQKVBias, kProjQKV);
    }
    TORCH_CHECK(qkv.size(-1) == q_size + 2 * kv_size, "decode_layers: layer ", i, " qkv width ", qkv.size(-1),
                " does not fit the head counts");
    at::Tensor q = qkv.narrow(-1, 0, q_size), k = qkv.narrow(-1, q_size, kv_size);
    const at::Tensor v = qkv.narrow(-1, q_size + kv_size, kv_size);
    {
      STAGE("decode_layers/rotary");
      if (layer.has(kQNorm) && layer.has(kKNorm)) {  // Qwen3: per-head RMSNorm before rope
        q = pagedserve_cpu::rms_norm(q.reshape({-1, head_size}), layer.get(kQNorm), eps).view(q.sizes());
        k = pagedserve_cpu::rms_norm(k.reshape({-1, head_size}), layer.get(kKNorm), eps).view(k.sizes());
      }
      std::tie(q, k) = pagedserve_cpu::rotary_embedding(positions, q, k, cos_sin_cache, head_size, is_neox);
    }
    // Attention.forward on a decode-only batch: write this token's K/V, then attend over the cache.
    at::Tensor attn;
    {
      STAGE("decode_layers/attention");
      pagedserve_cpu::reshape_and_cache(k.view({tokens, num_kv_heads, head_size}),
                                        v.view({tokens, num_kv_heads, head_size}), key_caches[i], value_caches[i],
                                        slot_mapping);
      attn = pagedserve_cpu::paged_decode_attention(q.view({tokens, num_heads, head_size}), key_caches[i],
                                                    value_caches[i], block_tables, seq_lens, scale,
                                                    sliding_windows[i]);
    }
    {
      STAGE("decode_layers/o_proj");
      hidden = layer.row(attn.view({tokens, q_size}), kO, kOBias, kProjO);
    }
    // Post-attention norm, then GatedMLP.forward.
    {
      STAGE("decode_layers/post_norm");
      std::tie(hidden, residual) = pagedserve_cpu::fused_add_rms_norm(hidden, residual, layer.get(kPostNorm), eps);
    }
    at::Tensor gate_up;
    {
      STAGE("decode_layers/gate_up_proj");
      gate_up = layer.column(hidden, kGateUp, kGateUpBias, kProjGateUp);
    }
    at::Tensor activated;
    {
      STAGE("decode_layers/silu_and_mul");
      activated = pagedserve_cpu::silu_and_mul(gate_up);
    }
    {
      STAGE("decode_layers/down_proj");
      hidden = layer.row(activated, kDown, kDownBias, kProjDown);
    }
  }
  return {hidden, residual};
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("decode_layers", &decode_layers); }
