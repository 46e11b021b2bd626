// The quantized matmul loops: an AVX2/FMA one chosen at run time on x86-64, and a
// scalar one everywhere. Both compute the same float32 operations in the same order:
// per group, w = q * s + b (one fused multiply-add), then 16 running sums per row
// (two vectors of 8 lanes; which input feeds which sum: sum_of) of x * w, added up at
// the end in a fixed tree. So the scalar loop is a bit-exact model of the vector one.
#include "kernel.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace mlxinfer {

namespace {

constexpr int kLanes = 8;
constexpr int kMaxBlockRows = 4; // rows sharing one unpacking of the weights
constexpr int kManyRows = 5;     // from here each output row is dequantized once for all rows

std::atomic<bool> scalar_forced{false};

float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else { // subnormal: normalise
    int shift = 0;
    while ((mantissa & 0x400) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    bits = sign | (static_cast<uint32_t>(113 - shift) << 23) | ((mantissa & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

float bfloat_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Scale or bias `index` (row-major [out, in / group]) as a float.
inline float scale_at(const void* data, ScaleType type, size_t index) {
  switch (type) {
    case ScaleType::float32:
      return static_cast<const float*>(data)[index];
    case ScaleType::float16:
      return half_to_float(static_cast<const uint16_t*>(data)[index]);
    default:
      return bfloat_to_float(static_cast<const uint16_t*>(data)[index]);
  }
}

// The 8 integers starting at a byte boundary of the bit stream (8 values take `bits` bytes).
template <int BITS>
inline void unpack_scalar(const uint8_t* p, uint32_t q[kLanes]) {
  uint64_t u = 0;
  std::memcpy(&u, p, BITS);
  for (int j = 0; j < kLanes; ++j) {
    q[j] = static_cast<uint32_t>(u >> (BITS * j)) & ((1u << BITS) - 1);
  }
}

// (a0 + a1) summed over its 8 lanes as the vector loop does: halves, then pairs.
inline float tree_sum(const float a0[kLanes], const float a1[kLanes]) {
  float v[kLanes], h[4];
  for (int j = 0; j < kLanes; ++j) {
    v[j] = a0[j] + a1[j];
  }
  for (int j = 0; j < 4; ++j) {
    h[j] = v[j] + v[j + 4];
  }
  return (h[0] + h[2]) + (h[1] + h[3]);
}

// Which of the 16 running sums (vector, lane) input i of a 16-input chunk feeds. 4-bit
// weights are read a byte at a time, two per byte, so even inputs go to the first
// vector and odd ones to the second; other widths fill the vectors in input order.
template <int BITS>
constexpr int sum_of(int i) {
  return BITS == 4 ? (i % 2) * kLanes + i / 2 : i;
}

template <int BITS>
void rows_scalar(const QuantizedMatrix& m, const float* x, int rows, float* y, int n0, int n1) {
  const size_t row_bytes = static_cast<size_t>(m.in) * BITS / 8;
  const int groups = m.in / m.group;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* w = m.packed + n * row_bytes;
    for (int r = 0; r < rows; ++r) {
      const float* xr = x + static_cast<size_t>(r) * m.in;
      float acc[2 * kLanes] = {};
      for (int g = 0; g < groups; ++g) {
        float s = scale_at(m.scales, m.scale_type, static_cast<size_t>(n) * groups + g);
        float b = scale_at(m.biases, m.scale_type, static_cast<size_t>(n) * groups + g);
        for (int k = g * m.group; k < (g + 1) * m.group; k += 2 * kLanes) {
          uint32_t q[2 * kLanes];
          unpack_scalar<BITS>(w + k * BITS / 8, q);
          unpack_scalar<BITS>(w + (k + kLanes) * BITS / 8, q + kLanes);
          for (int i = 0; i < 2 * kLanes; ++i) {
            float& a = acc[sum_of<BITS>(i)];
            a = std::fma(xr[k + i], std::fma(static_cast<float>(q[i]), s, b), a);
          }
        }
      }
      y[static_cast<size_t>(r) * m.out + n] = tree_sum(acc, acc + kLanes);
    }
  }
}

#if defined(__x86_64__)

#define MLXINFER_AVX2 __attribute__((target("avx2,fma,f16c")))

// 8 integers as floats: 8-bit values are whole bytes; narrower ones come from two
// 32-bit windows (values 0-3 and 4-7) shifted per lane.
template <int BITS>
MLXINFER_AVX2 inline __m256 unpack_avx2(const uint8_t* p) {
  if constexpr (BITS == 8) {
    __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  } else if constexpr (BITS == 2 || BITS == 4) { // all 8 in one 32-bit window
    uint32_t u = 0;
    std::memcpy(&u, p, BITS);
    const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS);
    __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(u)), shifts);
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32((1 << BITS) - 1)));
  } else { // 3, 5, 6 bits: two 32-bit windows, values 0-3 and 4-7
    uint64_t u = 0;
    std::memcpy(&u, p, BITS);
    const __m128i lo = _mm_set1_epi32(static_cast<int>(u));
    const __m128i hi = _mm_set1_epi32(static_cast<int>(u >> (4 * BITS)));
    const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 0, BITS, 2 * BITS, 3 * BITS);
    __m256i v = _mm256_srlv_epi32(_mm256_set_m128i(hi, lo), shifts);
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32((1 << BITS) - 1)));
  }
}

// The 16 integers of inputs [k, k + 16) of a packed row as floats, in the order the sums take
// them (sum_of): for 4 bits, 8 bytes' low nibbles (even inputs) then high nibbles (odd ones).
template <int BITS>
MLXINFER_AVX2 inline void unpack16_avx2(const uint8_t* w, int k, __m256& q0, __m256& q1) {
  if constexpr (BITS == 4) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k / 2)));
    q0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xf)));
    q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  } else {
    q0 = unpack_avx2<BITS>(w + k * BITS / 8);
    q1 = unpack_avx2<BITS>(w + (k + kLanes) * BITS / 8);
  }
}

// Scale or bias `index` as a float, with the CPU's half conversion (F16C comes with AVX2).
MLXINFER_AVX2 inline float scale_at_avx2(const void* data, ScaleType type, size_t index) {
  if (type == ScaleType::float16) {
    return _cvtsh_ss(static_cast<const uint16_t*>(data)[index]);
  }
  return scale_at(data, type, index);
}

MLXINFER_AVX2 inline float tree_sum_avx2(__m256 a0, __m256 a1) {
  __m256 v = _mm256_add_ps(a0, a1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 pairs = _mm_add_ps(h, _mm_movehl_ps(h, h)); // h0 + h2, h1 + h3
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

// R rows (1..4) against outputs [n0, n1): each 8 weights are unpacked once for all R.
template <int BITS, int R>
MLXINFER_AVX2 void block_avx2(const QuantizedMatrix& m, const float* x, float* y, int n0, int n1) {
  const size_t row_bytes = static_cast<size_t>(m.in) * BITS / 8;
  const int groups = m.in / m.group;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* w = m.packed + n * row_bytes;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
    for (int g = 0; g < groups; ++g) {
      const __m256 s = _mm256_set1_ps(scale_at_avx2(m.scales, m.scale_type, static_cast<size_t>(n) * groups + g));
      const __m256 b = _mm256_set1_ps(scale_at_avx2(m.biases, m.scale_type, static_cast<size_t>(n) * groups + g));
      for (int k = g * m.group; k < (g + 1) * m.group; k += 2 * kLanes) {
        __m256 q0, q1;
        unpack16_avx2<BITS>(w, k, q0, q1);
        const __m256 w0 = _mm256_fmadd_ps(q0, s, b);
        const __m256 w1 = _mm256_fmadd_ps(q1, s, b);
        for (int r = 0; r < R; ++r) {
          const float* xr = x + static_cast<size_t>(r) * m.in + k;
          acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + kLanes), w1, acc[r][1]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      y[static_cast<size_t>(r) * m.out + n] = tree_sum_avx2(acc[r][0], acc[r][1]);
    }
  }
}

// Row n of the matrix as the floats block_avx2 multiplies by: per 16-input chunk its w0 then
// its w1 (for 4 bits, even inputs then odd ones), each fma(q, s, b) as there.
template <int BITS>
MLXINFER_AVX2 void dequantized_row(const QuantizedMatrix& m, int n, float* out) {
  const size_t row_bytes = static_cast<size_t>(m.in) * BITS / 8;
  const int groups = m.in / m.group;
  const uint8_t* w = m.packed + n * row_bytes;
  for (int g = 0; g < groups; ++g) {
    const __m256 s = _mm256_set1_ps(scale_at_avx2(m.scales, m.scale_type, static_cast<size_t>(n) * groups + g));
    const __m256 b = _mm256_set1_ps(scale_at_avx2(m.biases, m.scale_type, static_cast<size_t>(n) * groups + g));
    for (int k = g * m.group; k < (g + 1) * m.group; k += 2 * kLanes) {
      __m256 q0, q1;
      unpack16_avx2<BITS>(w, k, q0, q1);
      _mm256_storeu_ps(out + k, _mm256_fmadd_ps(q0, s, b));
      _mm256_storeu_ps(out + k + kLanes, _mm256_fmadd_ps(q1, s, b));
    }
  }
}

// R rows (1 or 2) against the dequantized rows of NO outputs (1 or 2), register-blocked: each
// (row, output) accumulates exactly as block_avx2 does, so the result is the same bit for bit.
template <int R, int NO>
MLXINFER_AVX2 inline void tile_avx2(const float* x, int in, const float* const* w, float* y, int out) {
  __m256 acc[R][NO][2];
  for (int r = 0; r < R; ++r) {
    for (int o = 0; o < NO; ++o) {
      acc[r][o][0] = acc[r][o][1] = _mm256_setzero_ps();
    }
  }
  for (int k = 0; k < in; k += 2 * kLanes) {
    __m256 w0[NO], w1[NO];
    for (int o = 0; o < NO; ++o) {
      w0[o] = _mm256_loadu_ps(w[o] + k);
      w1[o] = _mm256_loadu_ps(w[o] + k + kLanes);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 x0 = _mm256_loadu_ps(x + static_cast<size_t>(r) * in + k);
      const __m256 x1 = _mm256_loadu_ps(x + static_cast<size_t>(r) * in + k + kLanes);
      for (int o = 0; o < NO; ++o) {
        acc[r][o][0] = _mm256_fmadd_ps(x0, w0[o], acc[r][o][0]);
        acc[r][o][1] = _mm256_fmadd_ps(x1, w1[o], acc[r][o][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int o = 0; o < NO; ++o) {
      y[static_cast<size_t>(r) * out + o] = tree_sum_avx2(acc[r][o][0], acc[r][o][1]);
    }
  }
}

// Many rows: each pair of outputs is dequantized once (into L1) for all rows, then multiplied
// two rows by two outputs at a time, where block_avx2 unpacks again for every 4 rows.
template <int BITS>
MLXINFER_AVX2 void many_rows_avx2(const QuantizedMatrix& m, const float* x, int rows, float* y, int n0, int n1) {
  thread_local std::vector<float> buffer;
  buffer.resize(2 * static_cast<size_t>(m.in));
  float* w[2] = {buffer.data(), buffer.data() + m.in};
  for (int n = n0; n < n1; n += 2) {
    const int outputs = n + 1 < n1 ? 2 : 1;
    for (int o = 0; o < outputs; ++o) {
      dequantized_row<BITS>(m, n + o, w[o]);
    }
    for (int r = 0; r < rows; r += 2) {
      const float* xr = x + static_cast<size_t>(r) * m.in;
      float* yr = y + static_cast<size_t>(r) * m.out + n;
      if (r + 1 < rows) {
        outputs == 2 ? tile_avx2<2, 2>(xr, m.in, w, yr, m.out) : tile_avx2<2, 1>(xr, m.in, w, yr, m.out);
      } else {
        outputs == 2 ? tile_avx2<1, 2>(xr, m.in, w, yr, m.out) : tile_avx2<1, 1>(xr, m.in, w, yr, m.out);
      }
    }
  }
}

// x with each 16-input chunk reordered as the 4-bit loop reads it (see sum_of).
const float* deinterleaved(const float* x, int rows, int in) {
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(rows) * in);
  for (size_t k = 0; k < buffer.size(); k += 2 * kLanes) {
    for (int i = 0; i < 2 * kLanes; ++i) {
      buffer[k + sum_of<4>(i)] = x[k + i];
    }
  }
  return buffer.data();
}

template <int BITS>
MLXINFER_AVX2 void rows_avx2(const QuantizedMatrix& m, const float* x, int rows, float* y, int n0, int n1) {
  if constexpr (BITS == 4) {
    x = deinterleaved(x, rows, m.in);
  }
  if (rows >= kManyRows) {
    return many_rows_avx2<BITS>(m, x, rows, y, n0, n1);
  }
  for (int r0 = 0; r0 < rows; r0 += kMaxBlockRows) {
    const float* xb = x + static_cast<size_t>(r0) * m.in;
    float* yb = y + static_cast<size_t>(r0) * m.out;
    switch (rows - r0 < kMaxBlockRows ? rows - r0 : kMaxBlockRows) {
      case 1: block_avx2<BITS, 1>(m, xb, yb, n0, n1); break;
      case 2: block_avx2<BITS, 2>(m, xb, yb, n0, n1); break;
      case 3: block_avx2<BITS, 3>(m, xb, yb, n0, n1); break;
      default: block_avx2<BITS, 4>(m, xb, yb, n0, n1); break;
    }
  }
}

bool cpu_has_avx2() {
  static const bool has =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return has;
}

#else

bool cpu_has_avx2() {
  return false;
}

#endif

bool use_avx2() {
  return cpu_has_avx2() && !scalar_forced.load(std::memory_order_relaxed);
}

template <int BITS>
void rows_for(const QuantizedMatrix& m, const float* x, int rows, float* y, int n0, int n1) {
#if defined(__x86_64__)
  if (use_avx2()) {
    return rows_avx2<BITS>(m, x, rows, y, n0, n1);
  }
#endif
  rows_scalar<BITS>(m, x, rows, y, n0, n1);
}

} // namespace

void quantized_matmul_range(const QuantizedMatrix& m, const float* x, int rows, float* y, int n0, int n1) {
  switch (m.bits) {
    case 2: return rows_for<2>(m, x, rows, y, n0, n1);
    case 3: return rows_for<3>(m, x, rows, y, n0, n1);
    case 4: return rows_for<4>(m, x, rows, y, n0, n1);
    case 5: return rows_for<5>(m, x, rows, y, n0, n1);
    case 6: return rows_for<6>(m, x, rows, y, n0, n1);
    default: return rows_for<8>(m, x, rows, y, n0, n1);
  }
}

const char* simd_name() {
  return use_avx2() ? "avx2+fma" : "scalar";
}

bool simd_avx2() {
  return use_avx2();
}

void force_scalar(bool on) {
  scalar_forced.store(on, std::memory_order_relaxed);
}

} // namespace mlxinfer
