#include "primitive.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <sstream>
#include <string>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "mlx/backend/cpu/encoder.h"

#include "common.h"
#include "kernel.h"

namespace mlxinfer {

// Helpers shared with layer.cpp (declared in common.h).
static int default_threads() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    return std::max(1, CPU_COUNT(&set));
  }
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

Pool& pool() {
  static Pool p(default_threads());
  return p;
}

ScaleType scale_type(mx::Dtype dtype) {
  if (dtype == mx::float32) {
    return ScaleType::float32;
  }
  if (dtype == mx::float16) {
    return ScaleType::float16;
  }
  if (dtype == mx::bfloat16) {
    return ScaleType::bfloat16;
  }
  throw std::invalid_argument("scales and biases must be float32, float16 or bfloat16");
}

namespace {

// A row-major copy of a strided view (a transposed or broadcast array); rare, so simple.
std::vector<uint8_t> row_major_copy(const mx::array& a) {
  const size_t item = a.itemsize();
  std::vector<uint8_t> out(a.size() * item);
  const auto* src = static_cast<const uint8_t*>(a.data<void>());
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t loc = 0;
    size_t rest = i;
    for (int d = a.ndim() - 1; d >= 0; --d) {
      loc += static_cast<int64_t>(rest % a.shape(d)) * a.strides()[d];
      rest /= a.shape(d);
    }
    std::copy_n(src + loc * item, item, out.data() + i * item);
  }
  return out;
}

} // namespace

const void* row_major(const mx::array& a, std::vector<uint8_t>& keep) {
  if (a.flags().row_contiguous) {
    return a.data<void>();
  }
  keep = row_major_copy(a);
  return keep.data();
}

std::string shape_text(const mx::array& a) {
  std::string text;
  for (int d : a.shape()) {
    text += (text.empty() ? "" : "x") + std::to_string(d);
  }
  return text;
}

int output_chunk(int out, int in) {
  const size_t weights = static_cast<size_t>(out) * in;
  return weights < kSplitFrom
      ? out
      : std::max(kOutputAlign, out / (kChunksPerThread * pool().size()) / kOutputAlign * kOutputAlign);
}

ProductTasks product_tasks(int rows, int out, int in) {
  if (rows < kGemmRows) {
    return {rows, out, rows, output_chunk(out, in)};
  }
  if (static_cast<size_t>(rows) * out * in < kSplitFrom) {
    return {rows, out, rows, out};
  }
  const int blocks = (rows + gemm_block_rows(in) - 1) / gemm_block_rows(in);
  const int row_block = ((rows + blocks - 1) / blocks + kGemmRowsAlign - 1) / kGemmRowsAlign * kGemmRowsAlign;
  const int chunks = std::max(1, (kChunksPerThread * pool().size() + blocks - 1) / blocks);
  const int chunk = ((out + chunks - 1) / chunks + kOutputAlign - 1) / kOutputAlign * kOutputAlign;
  return {rows, out, row_block, std::max(kOutputAlign, chunk)};
}

namespace {

// `experts`: 1 when w, scales and biases are stacked per expert (gather), else 0.
void check_arguments(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                     int group_size, int bits, int experts = 0) {
  std::ostringstream err;
  if (!supported_bits(bits)) {
    err << "bits must be 2, 3, 4, 5, 6 or 8, got " << bits;
  } else if (!supported_group(group_size)) {
    err << "group_size must be 32, 64 or 128, got " << group_size;
  } else if (!mx::issubdtype(x.dtype(), mx::floating) || x.ndim() < 1) {
    err << "x must be a floating-point array";
  } else if (w.dtype() != mx::uint32 || w.ndim() != 2 + experts) {
    err << "w must be a " << 2 + experts << "-D uint32 array";
  } else if (scales.dtype() != biases.dtype() || scales.shape() != biases.shape()) {
    err << "scales and biases must have the same shape and dtype";
  } else {
    const int in = x.shape(-1);
    if (in % group_size != 0 || static_cast<int64_t>(w.shape(-1)) * 32 != static_cast<int64_t>(in) * bits ||
        scales.ndim() != w.ndim() || scales.shape(-2) != w.shape(-2) || scales.shape(-1) != in / group_size ||
        (experts && scales.shape(0) != w.shape(0))) {
      err << "shapes do not match: x " << in << " inputs, w " << shape_text(w) << ", scales " << shape_text(scales)
          << " for " << bits << " bits, group " << group_size;
    }
  }
  if (!err.str().empty()) {
    throw std::invalid_argument(err.str());
  }
  scale_type(scales.dtype());
}

// Allocates `out` (float32), registers the arrays with MLX's CPU encoder and queues
// work(output data) on its thread.
template <typename Work>
void queue_on_cpu(mx::Stream stream, const std::vector<mx::array>& inputs, mx::array& out, Work work) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  encoder.dispatch([work = std::move(work), y = out.data<float>()]() { work(y); });
}

} // namespace

mx::array affine_quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                                  const mx::array& biases, int group_size, int bits) {
  check_arguments(x, w, scales, biases, group_size, bits);
  const mx::Stream cpu = mx::default_stream(mx::Device::cpu);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  mx::array y(shape, mx::float32, std::make_shared<AffineQuantizedMatmul>(cpu, group_size, bits),
              {mx::astype(x, mx::float32, cpu), w, scales, biases});
  const mx::Dtype dtype = mx::promote_types(x.dtype(), scales.dtype());
  return dtype == mx::float32 ? y : mx::astype(y, dtype, cpu);
}

mx::array affine_gather_quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                                         const mx::array& biases, const mx::array& indices, int group_size,
                                         int bits) {
  check_arguments(x, w, scales, biases, group_size, bits, 1);
  if (x.ndim() != 2 || indices.ndim() != 1 || indices.shape(0) != x.shape(0) ||
      !mx::issubdtype(indices.dtype(), mx::integer)) {
    throw std::invalid_argument("x must be [rows, in] and indices integer [rows]");
  }
  const mx::Stream cpu = mx::default_stream(mx::Device::cpu);
  mx::array y({x.shape(0), w.shape(1)}, mx::float32,
              std::make_shared<AffineQuantizedMatmul>(cpu, group_size, bits, true),
              {mx::astype(x, mx::float32, cpu), w, scales, biases, mx::astype(indices, mx::uint32, cpu)});
  const mx::Dtype dtype = mx::promote_types(x.dtype(), scales.dtype());
  return dtype == mx::float32 ? y : mx::astype(y, dtype, cpu);
}

void AffineQuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  queue_on_cpu(stream(), inputs, out, [inputs, group = group_size_, bits = bits_, gather = gather_](float* y) {
    const mx::array &x = inputs[0], &w = inputs[1], &scales = inputs[2], &biases = inputs[3];
    std::vector<uint8_t> keep[5];
    QuantizedMatrix m{static_cast<const uint8_t*>(row_major(w, keep[1])),
                      row_major(scales, keep[2]),
                      row_major(biases, keep[3]),
                      scale_type(scales.dtype()),
                      w.shape(-2),
                      x.shape(-1),
                      bits,
                      group};
    const auto* xs = static_cast<const float*>(row_major(x, keep[0]));
    const int rows = static_cast<int>(x.size() / m.in);
    if (!gather) {
      const ProductTasks tasks = product_tasks(rows, m.out, m.in);
      pool().run(tasks.count(), [&](int t) {
        const auto [r0, r1, n0, n1] = tasks.at(t);
        quantized_matmul_range(m, xs + static_cast<size_t>(r0) * m.in, r1 - r0, y + static_cast<size_t>(r0) * m.out,
                               n0, n1);
      });
      return;
    }
    const int chunk = output_chunk(m.out, m.in);
    const int per_matrix = (m.out + chunk - 1) / chunk;
    // One row per routed token, against its expert's matrix: chunks over (row, outputs).
    const auto* experts = static_cast<const uint32_t*>(row_major(inputs[4], keep[4]));
    const size_t packed_size = static_cast<size_t>(m.out) * m.in * bits / 8;
    const size_t scales_size = static_cast<size_t>(m.out) * (m.in / group) * scales.itemsize();
    pool().run(rows * per_matrix, [&](int c) {
      const int r = c / per_matrix, n0 = (c % per_matrix) * chunk;
      const size_t e = std::min<size_t>(experts[r], w.shape(0) - 1);
      QuantizedMatrix expert = m;
      expert.packed = m.packed + e * packed_size;
      expert.scales = static_cast<const uint8_t*>(m.scales) + e * scales_size;
      expert.biases = static_cast<const uint8_t*>(m.biases) + e * scales_size;
      quantized_matmul_range(expert, xs + static_cast<size_t>(r) * m.in, 1, y + static_cast<size_t>(r) * m.out, n0,
                             std::min(m.out, n0 + chunk));
    });
  });
}

void AffineQuantizedMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("MlxinferAffineQuantizedMatmul runs on the CPU only");
}

bool AffineQuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const AffineQuantizedMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && gather_ == o.gather_;
}

mx::array attention(const mx::array& q, const std::vector<mx::array>& caches, const std::vector<int>& lengths,
                    float scale, int window) {
  std::ostringstream err;
  if (q.dtype() != mx::float32 || q.ndim() != 4) {
    err << "q must be float32 [rows, heads, tokens, dims], got " << shape_text(q);
  } else if (caches.size() != 2 * static_cast<size_t>(q.shape(0)) || lengths.size() != static_cast<size_t>(q.shape(0))) {
    err << "need keys and values and a length for each of the " << q.shape(0) << " rows";
  } else if (window < 0) {
    err << "window must be 0 (none) or positive, got " << window;
  } else {
    for (size_t i = 0; i < caches.size() && err.str().empty(); ++i) {
      const mx::array& c = caches[i];
      const int length = lengths[i / 2];
      if (c.dtype() != mx::float32 || c.ndim() != 4 || c.shape(0) != 1 || c.shape(1) != caches[0].shape(1) ||
          c.shape(3) != q.shape(3) || c.shape(1) < 1 || q.shape(1) % c.shape(1) != 0 || length < q.shape(2) ||
          length > c.shape(2)) {
        err << "row " << i / 2 << "'s cache is " << shape_text(c) << " with " << length
            << " live slots for q " << shape_text(q);
      }
    }
  }
  if (!err.str().empty()) {
    throw std::invalid_argument(err.str());
  }
  const mx::Stream cpu = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{q};
  inputs.insert(inputs.end(), caches.begin(), caches.end());
  return mx::array(q.shape(), mx::float32, std::make_shared<Attention>(cpu, lengths, scale, window), inputs);
}

CachedHeads cached_heads(const mx::array& c, std::vector<uint8_t>& keep) {
  if (c.strides()[3] == 1) {
    return {c.data<float>(), c.strides()[1], c.strides()[2]};
  }
  const auto* data = static_cast<const float*>(row_major(c, keep));  // a strided view
  return {data, static_cast<int64_t>(c.shape(2)) * c.shape(3), c.shape(3)};
}

void Attention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  queue_on_cpu(stream(), inputs, out, [inputs, lengths = lengths_, scale = scale_, window = window_](float* y) {
    const mx::array& q = inputs[0];
    std::vector<std::vector<uint8_t>> keep(inputs.size());
    const auto* qs = static_cast<const float*>(row_major(q, keep[0]));
    const int rows = q.shape(0), heads = q.shape(1), tokens = q.shape(2), dims = q.shape(3);
    std::vector<CachedHeads> keys, values;
    for (size_t i = 1; i < inputs.size(); i += 2) {
      keys.push_back(cached_heads(inputs[i], keep[i]));
      values.push_back(cached_heads(inputs[i + 1], keep[i + 1]));
    }
    const AttentionShape shape{heads, inputs[1].shape(1), dims, tokens, scale, window};
    const AttentionOutput into{y, static_cast<int64_t>(heads) * tokens * dims, dims,
                               static_cast<int64_t>(tokens) * dims};
    mlxinfer::attention(qs, keys.data(), values.data(), lengths.data(), rows, shape, into, pool());
  });
}

void Attention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("MlxinferAttention runs on the CPU only");
}

bool Attention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Attention&>(other);
  return lengths_ == o.lengths_ && scale_ == o.scale_ && window_ == o.window_;
}

mx::array logsumexp(const mx::array& x) {
  if (x.dtype() != mx::float32 || x.ndim() != 2 || x.shape(1) < 1) {
    throw std::invalid_argument("logsumexp takes float32 rows [rows, n], n >= 1; got " + shape_text(x));
  }
  const mx::Stream cpu = mx::default_stream(mx::Device::cpu);
  return mx::array({x.shape(0), 1}, mx::float32, std::make_shared<LogSumExp>(cpu), {x});
}

void LogSumExp::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  queue_on_cpu(stream(), inputs, outputs[0], [x = inputs[0]](float* y) {
    std::vector<uint8_t> keep;
    const auto* data = static_cast<const float*>(row_major(x, keep));
    const int n = x.shape(1);
    for (int r = 0; r < x.shape(0); ++r) {
      y[r] = mlxinfer::logsumexp(data + static_cast<size_t>(r) * n, n);
    }
  });
}

void LogSumExp::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("MlxinferLogSumExp runs on the CPU only");
}

int threads() {
  return pool().size();
}

double peak_gflops() {
  constexpr long kRounds = 1 << 22;  // ~10-20 ms a thread
  double best = 0;
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::atomic<double> flops{0};
    const auto start = std::chrono::steady_clock::now();
    pool().run(pool().size(), [&](int) { flops.fetch_add(fma_flops(kRounds)); });
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, flops.load() / seconds / 1e9);
  }
  return best;
}

void set_threads(int n) {
  if (n < 1) {
    throw std::invalid_argument("threads must be at least 1");
  }
  pool().resize(n);
}

} // namespace mlxinfer
