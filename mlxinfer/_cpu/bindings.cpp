// Python module mlxinfer._cpu_qmm: the op, the thread count, and what was built.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mlx/version.h"

#include "kernel.h"
#include "primitive.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_cpu_qmm, m) {
  m.doc() = "y = x @ dequantize(w).T for MLX's affine quantized format on the CPU (1 to a few rows)";
  m.def("affine_quantized_matmul", &mlxinfer::affine_quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a,
        "x [..., in] @ dequantize(w, scales, biases).T, accumulated in float32 in a fixed order per row.");
  m.def("affine_gather_quantized_matmul", &mlxinfer::affine_gather_quantized_matmul, "x"_a, "w"_a, "scales"_a,
        "biases"_a, "indices"_a, "group_size"_a, "bits"_a,
        "Row m of x [rows, in] @ dequantize(w[indices[m]]).T: one row per routed token (MoE experts).");
  m.def("decode_attention", &mlxinfer::decode_attention, "q"_a, "caches"_a, "lengths"_a, "scale"_a,
        "One query per head of each row b over the first lengths[b] slots of its own float32 K/V buffers "
        "(caches = [keys_0, values_0, keys_1, ...]), each (row, head) in one fixed order.");
  m.def("threads", &mlxinfer::threads, "Threads a matmul is split across (the calling one included).");
  m.def("set_threads", &mlxinfer::set_threads, "n"_a);
  m.def("simd", &mlxinfer::simd_name, "The loop in use on this CPU: 'avx2+fma' or 'scalar'.");
  m.def("force_scalar", &mlxinfer::force_scalar, "on"_a, "Run the scalar loop even where AVX2 is available.");
  // The MLX headers it was compiled against: the primitive's ABI is only valid with the same release.
  m.attr("mlx_version") = std::to_string(MLX_VERSION_MAJOR) + "." + std::to_string(MLX_VERSION_MINOR) + "." +
      std::to_string(MLX_VERSION_PATCH);
}
