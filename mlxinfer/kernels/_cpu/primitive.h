// The MLX side: an op that puts the quantized matmul of kernel.h into MLX's lazy graph
// as a custom Primitive, evaluated on the CPU stream.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlxinfer {

namespace mx = mlx::core;

// x [..., in] @ dequantize(w, scales, biases).T -> [..., out], for MLX's affine format
// (`w` uint32 [out, in * bits / 32], `scales` and `biases` [out, in / group_size]).
// Computed in float32; the result has the dtype mx.quantized_matmul would give.
mx::array affine_quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits);

// Row m of x [rows, in] @ dequantize(w[indices[m]]).T -> [rows, out] for stacked experts
// (`w` [experts, out, in * bits / 32], scales and biases [experts, out, in / group_size]):
// mx.gather_qmm for one row per routed token, with each row computed as above.
mx::array affine_gather_quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    const mx::array& indices,
    int group_size,
    int bits);

class AffineQuantizedMatmul : public mx::Primitive {
 public:
  // With `gather`, a fifth input holds each row's expert.
  AffineQuantizedMatmul(mx::Stream stream, int group_size, int bits, bool gather = false)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits), gather_(gather) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "MlxinferAffineQuantizedMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_;
  int bits_;
  bool gather_;
};

// Causal attention for a batch of sequences, each over its own cache: q [B, heads, tokens, dims]
// float32 (each row's newest `tokens` positions); `caches` holds keys then values of each row b,
// float32 [1, kv_heads, slots, dims] (the cache buffers as they lie, in position order), of which
// the first lengths[b] slots are live, the new ones last. Each query attends the slots up to its
// own, the last `window` of them when window > 0 (see kernel.h's `attention`); a row's output does
// not depend on the others. -> [B, heads, tokens, dims] float32.
mx::array attention(const mx::array& q, const std::vector<mx::array>& caches, const std::vector<int>& lengths,
                    float scale, int window);

class Attention : public mx::Primitive {
 public:
  Attention(mx::Stream stream, std::vector<int> lengths, float scale, int window)
      : mx::Primitive(stream), lengths_(std::move(lengths)), scale_(scale), window_(window) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "MlxinferAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  std::vector<int> lengths_;
  float scale_;
  int window_;
};

// [rows, 1]: each row of x [rows, n] (float32) as log(sum(exp(x))), for log-probabilities.
mx::array logsumexp(const mx::array& x);

class LogSumExp : public mx::Primitive {
 public:
  explicit LogSumExp(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "MlxinferLogSumExp";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

// Threads the matmuls split across (the calling thread included).
int threads();

// The pool's peak FLOP rate in billions a second: every thread running multiply-add chains in
// registers at the widest vector width in use (fma_flops), best of three ~20 ms runs.
double peak_gflops();
void set_threads(int n);

} // namespace mlxinfer
