// The decode-layer primitives of layer.h: the arithmetic of the per-op path (mx.fast.rms_norm,
// mx.fast.rope, SiLU/GELU, the quantized or float products) spelled out in float32 loops.
#include "layer.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "mlx/backend/cpu/encoder.h"

#include "common.h"
#include "kernel.h"

namespace mlxinfer {

namespace {

// One projection read from a primitive's inputs (see LinearSpec).
struct Projection {
  LinearSpec spec;
  int out = 0;
  int in = 0;
  QuantizedMatrix q{};
  const float* w = nullptr;
  const float* bias = nullptr;
  const float* lora_a = nullptr; // [slots, rank, in]
  const float* lora_b = nullptr; // [slots, rank, out]: B transposed
  int rank = 0;
};

// The projection whose arrays start at inputs[at]; strided arrays are copied into keep[index].
Projection projection(const std::vector<mx::array>& inputs, size_t at, const LinearSpec& spec,
                      std::vector<std::vector<uint8_t>>& keep) {
  Projection p;
  p.spec = spec;
  const mx::array& w = inputs[at];
  p.out = w.shape(0);
  if (spec.bits) {
    p.in = static_cast<int>(static_cast<int64_t>(w.shape(1)) * 32 / spec.bits);
    p.q = QuantizedMatrix{static_cast<const uint8_t*>(row_major(w, keep[at])),
                          row_major(inputs[at + 1], keep[at + 1]),
                          row_major(inputs[at + 2], keep[at + 2]),
                          scale_type(inputs[at + 1].dtype()),
                          p.out,
                          p.in,
                          spec.bits,
                          spec.group};
  } else {
    p.in = w.shape(1);
    p.w = static_cast<const float*>(row_major(w, keep[at]));
  }
  const size_t after = at + (spec.bits ? 3 : 1);
  if (spec.bias) {
    p.bias = static_cast<const float*>(row_major(inputs[after], keep[after]));
  }
  if (spec.lora) {
    const size_t a = after + (spec.bias ? 1 : 0);
    p.lora_a = static_cast<const float*>(row_major(inputs[a], keep[a]));
    p.lora_b = static_cast<const float*>(row_major(inputs[a + 1], keep[a + 1]));
    p.rank = inputs[a].shape(1);
  }
  return p;
}

// y [rows, out] = x [rows, in] @ W.T (+ bias) (+ B[s] (A[s] x) for row i's adapter slot
// s = slots[i], where given and not 0), split across the pool (product_tasks); the bias and then the
// update are added after the product, as `y + bias` and `y + delta` are on the per-op path.
void project(const Projection& p, const float* x, int rows, float* y, const std::vector<int>& slots = {}) {
  const bool adapted = p.lora_a != nullptr && !slots.empty();
  std::vector<float> low(adapted ? static_cast<size_t>(rows) * p.rank : 0);  // A[s] x per row
  for (int i = 0; adapted && i < rows; ++i) {
    const float* a = p.lora_a + static_cast<size_t>(slots[i]) * p.rank * p.in;
    for (int j = 0; slots[i] != 0 && j < p.rank; ++j) {
      low[static_cast<size_t>(i) * p.rank + j] = dot(a + static_cast<size_t>(j) * p.in, x + static_cast<size_t>(i) * p.in, p.in);
    }
  }
  const ProductTasks tasks = product_tasks(rows, p.out, p.in);
  pool().run(tasks.count(), [&](int t) {
    const auto [r0, r1, n0, n1] = tasks.at(t);
    const float* xt = x + static_cast<size_t>(r0) * p.in;
    float* yt = y + static_cast<size_t>(r0) * p.out;
    if (p.spec.bits) {
      quantized_matmul_range(p.q, xt, r1 - r0, yt, n0, n1);
    } else {
      float_matmul_range(p.w, p.in, xt, r1 - r0, yt, p.out, n0, n1);
    }
    if (p.bias != nullptr) {
      for (int r = r0; r < r1; ++r) {
        for (int n = n0; n < n1; ++n) {
          y[static_cast<size_t>(r) * p.out + n] += p.bias[n];
        }
      }
    }
    std::vector<float> delta(adapted ? n1 - n0 : 0);
    for (int i = r0; adapted && i < r1; ++i) {
      if (slots[i] == 0) {
        continue;
      }
      // delta = B[s] (A[s] x) over this chunk's outputs, then added, as `y + delta` is per op;
      // B is stored transposed [rank, out], so each term runs along the outputs.
      const float* bt = p.lora_b + static_cast<size_t>(slots[i]) * p.rank * p.out;
      std::fill(delta.begin(), delta.end(), 0.0f);
      for (int j = 0; j < p.rank; ++j) {
        axpy(low[static_cast<size_t>(i) * p.rank + j], bt + static_cast<size_t>(j) * p.out + n0, delta.data(), n1 - n0);
      }
      float* yi = y + static_cast<size_t>(i) * p.out;
      for (int n = n0; n < n1; ++n) {
        yi[n] += delta[n - n0];
      }
    }
  });
}

// Each of `rows` rows' slot repeated for its `tokens` tokens (the products' rows).
std::vector<int> token_slots(const std::vector<int>& slots, int tokens) {
  std::vector<int> out;
  for (int s : slots) {
    out.insert(out.end(), tokens, s);
  }
  return out;
}

// mx.fast.rms_norm on the CPU: x * rsqrt(mean(x^2) + eps), then * w (the mean summed in double,
// within rounding of MLX's own reduction).
void rms_norm(const float* x, const float* w, int n, float eps, float* out) {
  double squares = 0;
  for (int i = 0; i < n; ++i) {
    squares += static_cast<double>(x[i]) * x[i];
  }
  const float mean = static_cast<float>(squares) / static_cast<float>(n);
  const float inv = 1.0f / std::sqrt(mean + eps);
  for (int i = 0; i < n; ++i) {
    out[i] = (x[i] * inv) * w[i];
  }
}

// mx.fast.rope (not traditional) of one head at one position: the two halves of the first
// `dims` rotated by theta_i = position * inv_freq[i], then scaled by `factor` when not 1.
void rope(float* v, const float* cosines, const float* sines, int dims, float factor) {
  const int half = dims / 2;
  for (int i = 0; i < half; ++i) {
    const float x1 = v[i], x2 = v[i + half];
    float a = x1 * cosines[i] - x2 * sines[i];
    float b = x1 * sines[i] + x2 * cosines[i];
    if (factor != 1.0f) {
      a *= factor;
      b *= factor;
    }
    v[i] = a;
    v[i + half] = b;
  }
}

// nn.gelu_approx: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
float gelu_tanh(float x) {
  const float inner = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
  return 0.5f * x * (1.0f + std::tanh(inner));
}

// Allocates the float32 outputs, registers every array with MLX's CPU encoder and queues
// work(output pointers) on its thread.
template <typename Work>
void queue_on_cpu(mx::Stream stream, const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs,
                  Work work) {
  std::vector<float*> ys;
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    ys.push_back(o.data<float>());
  }
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  for (auto& o : outputs) {
    encoder.set_output_array(o);
  }
  encoder.dispatch([work = std::move(work), ys = std::move(ys)]() { work(ys); });
}

void check(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument(what);
  }
}

// A projection's arrays must be what its spec says and map `in` inputs to `out` outputs.
void check_linear(const std::vector<mx::array>& arrays, const LinearSpec& spec, int in, int out,
                  const char* name) {
  std::ostringstream what;
  what << name << ": expected " << spec.count() << " arrays for " << spec.bits << " bits"
       << (spec.bias ? " with a bias" : "") << " mapping " << in << " inputs to " << out;
  check(static_cast<int>(arrays.size()) == spec.count(), what.str());
  const mx::array& w = arrays[0];
  if (spec.bits) {
    check(supported_bits(spec.bits) && supported_group(spec.group),
          what.str() + ", but there is no loop for " + std::to_string(spec.bits) + "-bit weights in groups of " +
              std::to_string(spec.group));
    check(w.dtype() == mx::uint32 && w.ndim() == 2 && w.shape(0) == out &&
              static_cast<int64_t>(w.shape(1)) * 32 == static_cast<int64_t>(in) * spec.bits &&
              in % spec.group == 0 && arrays[1].shape() == arrays[2].shape() &&
              arrays[1].dtype() == arrays[2].dtype() && arrays[1].ndim() == 2 && arrays[1].shape(0) == out &&
              arrays[1].shape(1) == in / spec.group,
          what.str() + ", got w " + shape_text(w) + ", scales " + shape_text(arrays[1]));
    scale_type(arrays[1].dtype());
  } else {
    check(w.dtype() == mx::float32 && w.ndim() == 2 && w.shape(0) == out && w.shape(1) == in,
          what.str() + ", got float w " + shape_text(w));
  }
  if (spec.bias) {
    const mx::array& b = arrays[spec.bits ? 3 : 1];
    check(b.dtype() == mx::float32 && b.ndim() == 1 && b.shape(0) == out, what.str() + ", got bias " + shape_text(b));
  }
  if (spec.lora) {
    const mx::array &a = arrays[arrays.size() - 2], &b = arrays.back();
    check(a.dtype() == mx::float32 && b.dtype() == mx::float32 && a.ndim() == 3 && b.ndim() == 3 &&
              a.shape(2) == in && b.shape(2) == out && b.shape(1) == a.shape(1) && b.shape(0) == a.shape(0),
          what.str() + ", got LoRA stacks A " + shape_text(a) + " and B " + shape_text(b));
  }
}

// A projection's arrays followed by its LoRA stacks (`lora` empty or [A, B]), and its spec saying so.
std::vector<mx::array> with_lora(const std::vector<mx::array>& arrays, const std::vector<mx::array>& lora,
                                 LinearSpec& spec) {
  check(lora.empty() || lora.size() == 2, "LoRA stacks must be empty or [A, B]");
  spec.lora = !lora.empty();
  std::vector<mx::array> out(arrays);
  out.insert(out.end(), lora.begin(), lora.end());
  return out;
}

// Slots, when any projection has adapters: one per row, each below the stacks' slot count.
void check_slots(const std::vector<int>& slots, int rows, const std::vector<mx::array>& stacks) {
  if (stacks.empty()) {
    return;
  }
  check(static_cast<int>(slots.size()) == rows, "need an adapter slot for each row");
  for (const auto& a : stacks) {
    for (int s : slots) {
      check(s >= 0 && s < a.shape(0), "an adapter slot is outside the LoRA stacks");
    }
  }
}

void check_vector(const mx::array& a, int n, const char* name) {
  check(a.dtype() == mx::float32 && a.ndim() == 1 && a.shape(0) == n,
        std::string(name) + " must be float32 [" + std::to_string(n) + "], got " + shape_text(a));
}

mx::Stream cpu() {
  return mx::default_stream(mx::Device::cpu);
}

} // namespace

std::vector<mx::array> decode_layer_in(const mx::array& x, const mx::array& norm,
                                       const std::vector<mx::array>& qkv_base, const std::vector<mx::array>& qkv_lora,
                                       const std::vector<mx::array>& qk_norms,
                                       const std::vector<mx::array>& inv_freq, LayerInSpec spec) {
  const std::vector<mx::array> qkv = with_lora(qkv_base, qkv_lora, spec.qkv);
  check(x.dtype() == mx::float32 && x.ndim() == 3, "x must be float32 [rows, tokens, hidden]");
  const int rows = x.shape(0), tokens = x.shape(1), hidden = x.shape(2), dims = spec.head_dim;
  check(spec.heads > 0 && spec.kv_heads > 0 && spec.heads % spec.kv_heads == 0 && dims > 0,
        "heads must be a multiple of kv_heads");
  check(static_cast<int>(spec.positions.size()) == rows, "need one position per row");
  check_vector(norm, hidden, "the input norm");
  check_linear(qkv, spec.qkv, hidden, (spec.heads + 2 * spec.kv_heads) * dims, "qkv");
  check_slots(spec.slots, rows, qkv_lora);
  check(qk_norms.empty() || qk_norms.size() == 2, "qk_norms must be empty or [q_norm, k_norm]");
  spec.qk_norm = !qk_norms.empty();
  for (const auto& n : qk_norms) {
    check_vector(n, dims, "a q/k norm");
  }
  check(inv_freq.size() <= 1, "inv_freq must be empty or one table");
  spec.rope_dims = inv_freq.empty() ? 0 : 2 * inv_freq[0].size();
  if (!inv_freq.empty()) {
    check_vector(inv_freq[0], spec.rope_dims / 2, "the RoPE table");
    check(spec.rope_dims <= dims, "the RoPE table is longer than half a head");
  }
  std::vector<mx::array> inputs{x, norm};
  inputs.insert(inputs.end(), qkv.begin(), qkv.end());
  inputs.insert(inputs.end(), qk_norms.begin(), qk_norms.end());
  inputs.insert(inputs.end(), inv_freq.begin(), inv_freq.end());
  std::vector<mx::Shape> shapes{{rows, spec.heads, tokens, dims}};
  for (int r = 0; r < rows; ++r) {
    shapes.push_back({1, spec.kv_heads, tokens, dims});
    shapes.push_back({1, spec.kv_heads, tokens, dims});
  }
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
  return mx::array::make_arrays(std::move(shapes), dtypes, std::make_shared<DecodeLayerIn>(cpu(), std::move(spec)),
                                inputs);
}

void DecodeLayerIn::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  queue_on_cpu(stream(), inputs, outputs, [inputs, spec = spec_](const std::vector<float*>& ys) {
    std::vector<std::vector<uint8_t>> keep(inputs.size());
    const mx::array& x = inputs[0];
    const int rows = x.shape(0), tokens = x.shape(1), hidden = x.shape(2), dims = spec.head_dim;
    const int heads = spec.heads, kv_heads = spec.kv_heads, all = rows * tokens;
    const auto* xs = static_cast<const float*>(row_major(x, keep[0]));
    const auto* norm = static_cast<const float*>(row_major(inputs[1], keep[1]));
    const Projection qkv = projection(inputs, 2, spec.qkv, keep);
    size_t at = 2 + spec.qkv.count();
    const float *q_norm = nullptr, *k_norm = nullptr, *inv_freq = nullptr;
    if (spec.qk_norm) {
      q_norm = static_cast<const float*>(row_major(inputs[at], keep[at]));
      k_norm = static_cast<const float*>(row_major(inputs[at + 1], keep[at + 1]));
      at += 2;
    }
    if (spec.rope_dims) {
      inv_freq = static_cast<const float*>(row_major(inputs[at], keep[at]));
    }

    std::vector<float> h(static_cast<size_t>(all) * hidden);
    for (int i = 0; i < all; ++i) {
      rms_norm(xs + static_cast<size_t>(i) * hidden, norm, hidden, spec.eps, h.data() + static_cast<size_t>(i) * hidden);
    }
    std::vector<float> projected(static_cast<size_t>(all) * qkv.out);
    project(qkv, h.data(), all, projected.data(), token_slots(spec.slots, tokens));

    const int half = spec.rope_dims / 2;
    std::vector<float> cosines(half), sines(half), head(dims);
    for (int i = 0; i < all; ++i) {
      const int r = i / tokens, t = i % tokens;
      // theta = float(position) * inv_freq, one float32 product as mx.fast.rope's fallback forms it
      const float position = static_cast<float>(spec.positions[r] + t);
      for (int i = 0; i < half; ++i) {
        const float theta = position * inv_freq[i];
        cosines[i] = std::cos(theta);
        sines[i] = std::sin(theta);
      }
      const float* row = projected.data() + static_cast<size_t>(i) * qkv.out;
      auto finish = [&](const float* src, const float* weight, bool rotate, float* dst) {
        if (weight != nullptr) {
          rms_norm(src, weight, dims, spec.qk_eps, dst);
        } else {
          std::copy_n(src, dims, dst);
        }
        if (rotate && half) {
          rope(dst, cosines.data(), sines.data(), spec.rope_dims, spec.attention_factor);
        }
      };
      for (int hd = 0; hd < heads; ++hd) {
        finish(row + hd * dims, q_norm, true, ys[0] + ((static_cast<size_t>(r) * heads + hd) * tokens + t) * dims);
      }
      for (int hd = 0; hd < kv_heads; ++hd) {
        const size_t at = (static_cast<size_t>(hd) * tokens + t) * dims;
        finish(row + (heads + hd) * dims, k_norm, true, ys[1 + 2 * r] + at);
        finish(row + (heads + kv_heads + hd) * dims, nullptr, false, ys[2 + 2 * r] + at);
      }
    }
  });
}

void DecodeLayerIn::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("MlxinferDecodeLayerIn runs on the CPU only");
}

mx::array decode_layer_out(const mx::array& x, const mx::array& q, const std::vector<mx::array>& o_base,
                           const std::vector<mx::array>& norms, const std::vector<mx::array>& gate_up_base,
                           const std::vector<mx::array>& down_base, const std::vector<std::vector<mx::array>>& loras,
                           const std::vector<mx::array>& caches, LayerOutSpec spec) {
  check(loras.size() == 3, "loras must hold o's, gate_up's and down's stacks");
  const std::vector<mx::array> o = with_lora(o_base, loras[0], spec.o);
  const std::vector<mx::array> gate_up = with_lora(gate_up_base, loras[1], spec.gate_up);
  const std::vector<mx::array> down = with_lora(down_base, loras[2], spec.down);
  check(x.dtype() == mx::float32 && x.ndim() == 3, "x must be float32 [rows, tokens, hidden]");
  const int rows = x.shape(0), tokens = x.shape(1), hidden = x.shape(2), dims = spec.head_dim;
  check(q.dtype() == mx::float32 && q.shape() == mx::Shape{rows, spec.heads, tokens, dims},
        "q must be float32 [rows, heads, tokens, head_dim], got " + shape_text(q));
  check(spec.kv_heads > 0 && spec.heads % spec.kv_heads == 0, "heads must be a multiple of kv_heads");
  check(static_cast<int>(spec.lengths.size()) == rows && static_cast<int>(caches.size()) == 2 * rows,
        "need keys, values and a length for each row");
  for (size_t i = 0; i < caches.size(); ++i) {
    const mx::array& c = caches[i];
    const int length = spec.lengths[i / 2];
    check(c.dtype() == mx::float32 && c.ndim() == 4 && c.shape(0) == 1 && c.shape(1) == spec.kv_heads &&
              c.shape(3) == dims && length >= tokens && length <= c.shape(2),
          "row " + std::to_string(i / 2) + "'s cache is " + shape_text(c) + " with " + std::to_string(length) +
              " live slots");
  }
  check_linear(o, spec.o, spec.heads * dims, hidden, "o");
  check(norms.size() == 1 || norms.size() == 3, "norms must be [pre-MLP] or [post-attention, pre-MLP, post-MLP]");
  spec.sandwich = norms.size() == 3;
  for (const auto& n : norms) {
    check_vector(n, hidden, "a norm");
  }
  check(gate_up.size() > 0 && gate_up[0].ndim() == 2 && gate_up[0].shape(0) % 2 == 0, "gate_up must be [2 * intermediate, ...]");
  const int intermediate = gate_up[0].shape(0) / 2;
  check_linear(gate_up, spec.gate_up, hidden, 2 * intermediate, "gate_up");
  check_linear(down, spec.down, intermediate, hidden, "down");
  std::vector<mx::array> stacks;
  for (const auto& l : loras) {
    stacks.insert(stacks.end(), l.begin(), l.end());
  }
  check_slots(spec.slots, rows, stacks);
  std::vector<mx::array> inputs{x, q};
  inputs.insert(inputs.end(), o.begin(), o.end());
  inputs.insert(inputs.end(), norms.begin(), norms.end());
  inputs.insert(inputs.end(), gate_up.begin(), gate_up.end());
  inputs.insert(inputs.end(), down.begin(), down.end());
  inputs.insert(inputs.end(), caches.begin(), caches.end());
  return mx::array(x.shape(), mx::float32, std::make_shared<DecodeLayerOut>(cpu(), std::move(spec)), inputs);
}

void DecodeLayerOut::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  queue_on_cpu(stream(), inputs, outputs, [inputs, spec = spec_](const std::vector<float*>& ys) {
    std::vector<std::vector<uint8_t>> keep(inputs.size());
    const mx::array& x = inputs[0];
    const int rows = x.shape(0), tokens = x.shape(1), hidden = x.shape(2), dims = spec.head_dim, heads = spec.heads;
    const int all = rows * tokens;
    const auto* xs = static_cast<const float*>(row_major(x, keep[0]));
    const auto* qs = static_cast<const float*>(row_major(inputs[1], keep[1]));
    size_t at = 2;
    const Projection o = projection(inputs, at, spec.o, keep);
    at += spec.o.count();
    // [pre-MLP] or, for sandwich norms, [post-attention, pre-MLP, post-MLP]
    std::vector<const float*> norms;
    for (int n = 0; n < (spec.sandwich ? 3 : 1); ++n, ++at) {
      norms.push_back(static_cast<const float*>(row_major(inputs[at], keep[at])));
    }
    const float* pre_mlp = norms[spec.sandwich ? 1 : 0];
    const Projection gate_up = projection(inputs, at, spec.gate_up, keep);
    at += spec.gate_up.count();
    const Projection down = projection(inputs, at, spec.down, keep);
    at += spec.down.count();

    // Attention: the tiled kernel over each row's cache, written [rows * tokens, heads * dims] for o.
    std::vector<CachedHeads> keys, values;
    for (size_t i = at; i < inputs.size(); i += 2) {
      keys.push_back(cached_heads(inputs[i], keep[i]));
      values.push_back(cached_heads(inputs[i + 1], keep[i + 1]));
    }
    std::vector<float> attended(static_cast<size_t>(all) * heads * dims);
    const AttentionShape shape{heads, spec.kv_heads, dims, tokens, spec.scale};
    const AttentionOutput into{attended.data(), static_cast<int64_t>(tokens) * heads * dims,
                               static_cast<int64_t>(heads) * dims, dims};
    attention(qs, keys.data(), values.data(), spec.lengths.data(), rows, shape, into, pool());

    // x + o(attention), then + down(act(gate) * up) of its norm; sandwich norms also norm each
    // sublayer's output before its residual add (Gemma).
    float* y = ys[0];
    const std::vector<int> slots = token_slots(spec.slots, tokens);
    project(o, attended.data(), all, y, slots);
    for (int i = 0; spec.sandwich && i < all; ++i) {
      rms_norm(y + static_cast<size_t>(i) * hidden, norms[0], hidden, spec.eps, y + static_cast<size_t>(i) * hidden);
    }
    for (size_t i = 0; i < static_cast<size_t>(all) * hidden; ++i) {
      y[i] = xs[i] + y[i];
    }
    std::vector<float> h(static_cast<size_t>(all) * hidden);
    for (int i = 0; i < all; ++i) {
      rms_norm(y + static_cast<size_t>(i) * hidden, pre_mlp, hidden, spec.eps, h.data() + static_cast<size_t>(i) * hidden);
    }
    const int inter = gate_up.out / 2;
    std::vector<float> gu(static_cast<size_t>(all) * gate_up.out), act(static_cast<size_t>(all) * inter);
    project(gate_up, h.data(), all, gu.data(), slots);
    for (int r = 0; r < all; ++r) {
      const float* g = gu.data() + static_cast<size_t>(r) * gate_up.out;
      const float* u = g + inter;
      float* a = act.data() + static_cast<size_t>(r) * inter;
      if (!spec.gelu) {
        silu_gate(g, u, a, inter);
        continue;
      }
      for (int i = 0; i < inter; ++i) {
        a[i] = gelu_tanh(g[i]) * u[i];
      }
    }
    std::vector<float> d(static_cast<size_t>(all) * hidden);
    project(down, act.data(), all, d.data(), slots);
    for (int i = 0; spec.sandwich && i < all; ++i) {
      rms_norm(d.data() + static_cast<size_t>(i) * hidden, norms[2], hidden, spec.eps,
               d.data() + static_cast<size_t>(i) * hidden);
    }
    for (size_t i = 0; i < d.size(); ++i) {
      y[i] = y[i] + d[i];
    }
  });
}

void DecodeLayerOut::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("MlxinferDecodeLayerOut runs on the CPU only");
}

} // namespace mlxinfer
