// One step of a pre-norm transformer block (Llama, Mistral, Qwen2/3, SmolLM, Phi-3 and the like)
// over a few new tokens per sequence (a decode step, a short prompt chunk) as two CPU primitives
// in place of the ~60 small MLX ops the same step takes on the CPU, where every op costs a fixed
// dispatch and rope and rms_norm are themselves built of ops.
//
// The step is cut in two around the cache: `decode_layer_in` gives the rotated queries and the
// new keys and values (norm -> QKV -> q/k norm -> RoPE), the caller stores the keys and values
// in each row's cache as the per-op path does, and `decode_layer_out` attends over the caches
// and finishes the block (attention -> O -> residual -> norm -> gate/up -> activation -> down ->
// residual). Each projection's outputs are split across the thread pool; every row is computed
// by the same loops whatever else is in the batch, so a sequence's numbers never depend on it.
#pragma once

#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlxinfer {

namespace mx = mlx::core;

// How one projection's arrays follow each other in a primitive's inputs: [w] for float32
// weights (bits 0), or [w, scales, biases] in MLX's affine format; then its bias when it has one;
// then, with LoRA adapters, their stacked float32 A [slots, rank, in] and B transposed [slots, rank,
// out] (the scale folded into B, slot 0 the base's zeros): row r adds B[s] (A[s] x) for its slot s.
struct LinearSpec {
  int bits = 0;
  int group = 0;
  bool bias = false;
  bool lora = false;

  int count() const {
    return (bits ? 3 : 1) + (bias ? 1 : 0) + (lora ? 2 : 0);
  }
  bool operator==(const LinearSpec&) const = default;
};

struct LayerInSpec {
  int heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  float eps = 0;     // the input norm's
  float qk_eps = 0;  // the per-head q/k norms' (when qk_norm)
  LinearSpec qkv;
  bool qk_norm = false;
  int rope_dims = 0; // 0: the layer has no rotary embedding
  float attention_factor = 1;
  std::vector<int> positions; // each row's first new position
  std::vector<int> slots;     // each row's adapter slot (empty: no projection has adapters)
  bool operator==(const LayerInSpec&) const = default;
};

struct LayerOutSpec {
  int heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  float scale = 0; // of the attention scores
  float eps = 0;   // the norms'
  bool sandwich = false; // also a norm on each sublayer's output (Gemma)
  LinearSpec o, gate_up, down;
  bool gelu = false; // tanh-approximated GELU (GeGLU) instead of SiLU
  std::vector<int> lengths; // each row's live cache slots, the new ones (its last `tokens`) included
  std::vector<int> slots;   // each row's adapter slot (empty: no projection has adapters)
  bool operator==(const LayerOutSpec&) const = default;
};

// x [rows, tokens, hidden] float32; `qkv` the fused q/k/v projection's arrays (see LinearSpec);
// `qk_norms` empty or the per-head [q_norm, k_norm] weights; `inv_freq` empty or the RoPE
// table [rope_dims / 2] (float32, as mx.fast.rope derives it). -> [q [rows, heads, tokens, dims],
// then for each row its keys and values [1, kv_heads, tokens, dims]].
std::vector<mx::array> decode_layer_in(const mx::array& x, const mx::array& norm, const std::vector<mx::array>& qkv,
                                       const std::vector<mx::array>& qkv_lora, const std::vector<mx::array>& qk_norms,
                                       const std::vector<mx::array>& inv_freq, LayerInSpec spec);

// x [rows, tokens, hidden] the block's input (the residual), q from decode_layer_in, `caches`
// [keys_0, values_0, keys_1, ...] each row's float32 buffers [1, kv_heads, slots, dims] with
// the new entries stored; each new token attends causally (to its row's slots up to itself).
// `norms`: [pre-MLP norm], or [post-attention, pre-MLP, post-MLP] for sandwich norms.
// -> the block's output [rows, tokens, hidden].
// `loras`: for o, gate_up and down, empty or that projection's [A, B] stacks (see LinearSpec).
mx::array decode_layer_out(const mx::array& x, const mx::array& q, const std::vector<mx::array>& o,
                           const std::vector<mx::array>& norms, const std::vector<mx::array>& gate_up,
                           const std::vector<mx::array>& down, const std::vector<std::vector<mx::array>>& loras,
                           const std::vector<mx::array>& caches, LayerOutSpec spec);

class DecodeLayerIn : public mx::Primitive {
 public:
  DecodeLayerIn(mx::Stream stream, LayerInSpec spec) : mx::Primitive(stream), spec_(std::move(spec)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MlxinferDecodeLayerIn";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return spec_ == static_cast<const DecodeLayerIn&>(other).spec_;
  }

 private:
  LayerInSpec spec_;
};

class DecodeLayerOut : public mx::Primitive {
 public:
  DecodeLayerOut(mx::Stream stream, LayerOutSpec spec) : mx::Primitive(stream), spec_(std::move(spec)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MlxinferDecodeLayerOut";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return spec_ == static_cast<const DecodeLayerOut&>(other).spec_;
  }

 private:
  LayerOutSpec spec_;
};

} // namespace mlxinfer
