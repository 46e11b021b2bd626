// Python module mlxinfer.kernels._cpu_qmm: the op, the thread count, and what was built.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mlx/version.h"

#include "kernel.h"
#include "layer.h"
#include "primitive.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace {

// A projection's spec from its arrays: [w(, bias)] when bits is 0, else [w, scales, biases(, bias)].
mlxinfer::LinearSpec linear(const std::vector<mx::array>& arrays, int bits, int group) {
  mlxinfer::LinearSpec spec;
  spec.bits = bits;
  spec.group = group;
  spec.bias = static_cast<int>(arrays.size()) == (bits ? 4 : 2);
  return spec;
}

} // namespace

NB_MODULE(_cpu_qmm, m) {
  m.doc() = "y = x @ dequantize(w).T for MLX's affine quantized format on the CPU (1 to a few rows)";
  m.def("affine_quantized_matmul", &mlxinfer::affine_quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a,
        "x [..., in] @ dequantize(w, scales, biases).T, accumulated in float32 in a fixed order per row.");
  m.def("affine_gather_quantized_matmul", &mlxinfer::affine_gather_quantized_matmul, "x"_a, "w"_a, "scales"_a,
        "biases"_a, "indices"_a, "group_size"_a, "bits"_a,
        "Row m of x [rows, in] @ dequantize(w[indices[m]]).T: one row per routed token (MoE experts).");
  m.def("attention",
        static_cast<mx::array (*)(const mx::array&, const std::vector<mx::array>&, const std::vector<int>&, float, int)>(
            &mlxinfer::attention), "q"_a, "caches"_a, "lengths"_a, "scale"_a, "window"_a = 0,
        "Causal attention of q [rows, heads, tokens, dims] (each row's newest tokens) over the first lengths[b] "
        "slots of row b's own float32 K/V buffers (caches = [keys_0, values_0, keys_1, ...]), the last `window` "
        "slots up to each query when window > 0; tiled, each query in one fixed order.");
  m.def(
      "decode_layer_in",
      [](const mx::array& x, const mx::array& norm, const std::vector<mx::array>& qkv, int qkv_bits, int qkv_group,
         const std::vector<mx::array>& qkv_lora, const std::vector<mx::array>& qk_norms,
         const std::vector<mx::array>& inv_freq, const std::vector<int>& positions, const std::vector<int>& slots,
         int heads, int kv_heads, int head_dim, float eps, float qk_eps, float attention_factor) {
        mlxinfer::LayerInSpec spec;
        spec.heads = heads;
        spec.kv_heads = kv_heads;
        spec.head_dim = head_dim;
        spec.eps = eps;
        spec.qk_eps = qk_eps;
        spec.qkv = linear(qkv, qkv_bits, qkv_group);
        spec.attention_factor = attention_factor;
        spec.positions = positions;
        spec.slots = slots;
        return mlxinfer::decode_layer_in(x, norm, qkv, qkv_lora, qk_norms, inv_freq, std::move(spec));
      },
      "x"_a, "norm"_a, "qkv"_a, "qkv_bits"_a, "qkv_group"_a, "qkv_lora"_a, "qk_norms"_a, "inv_freq"_a, "positions"_a,
      "slots"_a, "heads"_a,
      "kv_heads"_a, "head_dim"_a, "eps"_a, "qk_eps"_a, "attention_factor"_a,
      "A step's first half of a pre-norm block: [q, keys_0, values_0, ...] (norm, QKV, q/k norm, RoPE). "
      "A projection is [w] or [w, bias] (float32, bits 0), or [w, scales, biases(, bias)] (affine); its LoRA "
      "stacks [A [slots, rank, in], B.T [slots, rank, out]] or [], each row r adding B[s] A[s] x for s = slots[r].");
  m.def(
      "decode_layer_out",
      [](const mx::array& x, const mx::array& q, const std::vector<mx::array>& o, int o_bits, int o_group,
         const std::vector<mx::array>& norms, const std::vector<mx::array>& gate_up, int gate_up_bits, int gate_up_group,
         const std::vector<mx::array>& down, int down_bits, int down_group,
         const std::vector<std::vector<mx::array>>& loras, const std::vector<mx::array>& caches,
         const std::vector<int>& lengths, const std::vector<int>& slots, int heads, int kv_heads, int head_dim,
         float scale, float eps, bool gelu) {
        mlxinfer::LayerOutSpec spec;
        spec.heads = heads;
        spec.kv_heads = kv_heads;
        spec.head_dim = head_dim;
        spec.scale = scale;
        spec.eps = eps;
        spec.o = linear(o, o_bits, o_group);
        spec.gate_up = linear(gate_up, gate_up_bits, gate_up_group);
        spec.down = linear(down, down_bits, down_group);
        spec.gelu = gelu;
        spec.lengths = lengths;
        spec.slots = slots;
        return mlxinfer::decode_layer_out(x, q, o, norms, gate_up, down, loras, caches, std::move(spec));
      },
      "x"_a, "q"_a, "o"_a, "o_bits"_a, "o_group"_a, "norms"_a, "gate_up"_a, "gate_up_bits"_a, "gate_up_group"_a,
      "down"_a, "down_bits"_a, "down_group"_a, "loras"_a, "caches"_a, "lengths"_a, "slots"_a, "heads"_a, "kv_heads"_a, "head_dim"_a,
      "scale"_a, "eps"_a, "gelu"_a,
      "A step's second half: causal attention over each row's stored cache, O, residual, norm, gated MLP, "
      "residual -> the block's output. norms: [pre-MLP] or [post-attention, pre-MLP, post-MLP] (sandwich).");
  m.def("logsumexp", static_cast<mx::array (*)(const mx::array&)>(&mlxinfer::logsumexp), "x"_a,
        "[rows, 1]: log(sum(exp(x))) of each float32 row, shifted by its maximum (AVX-512: 16 exps at once).");
  m.def("threads", &mlxinfer::threads, "Threads a matmul is split across (the calling one included).");
  m.def("peak_gflops", &mlxinfer::peak_gflops,
        "The threads' peak float32 rate, GFLOP/s: multiply-add chains in registers at the widest vector width in "
        "use (the roofline of the products).");
  m.def("set_threads", &mlxinfer::set_threads, "n"_a);
  m.def("simd", &mlxinfer::simd_name, "The widest loop in use on this CPU: 'avx512', 'avx2+fma' or 'scalar'.");
  m.def(
      "limit_simd",
      [](const std::string& name) {
        if (!mlxinfer::limit_simd(name.c_str())) {
          throw nb::value_error("limit_simd takes 'best', 'avx512', 'avx2+fma' or 'scalar'");
        }
      },
      "name"_a, "Cap the loops the CPU may run (tests compare them bit for bit).");
  // The MLX headers it was compiled against: the primitive's ABI is only valid with the same release.
  m.attr("mlx_version") = std::to_string(MLX_VERSION_MAJOR) + "." + std::to_string(MLX_VERSION_MINOR) + "." +
      std::to_string(MLX_VERSION_PATCH);
}
