// Decode attention (one query per head) over one sequence's float32 K/V cache, and the
// float32 dot products it and the float matmul share; see kernel.h. Scores, a max-subtracted softmax in float32, then the weighted sum of
// values, each in one fixed order; AVX2 where the CPU has it, else a scalar loop.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernel.h"
#include "simd.h"

namespace mlxinfer {

namespace {

float dot_scalar_loop(const float* a, const float* b, int n) {
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    sum += a[i] * b[i];
  }
  return sum;
}

void axpy_scalar(float p, const float* v, float* acc, int n) {
  for (int i = 0; i < n; ++i) {
    acc[i] += p * v[i];
  }
}

// g * sigmoid(g) * u with MLX's sigmoid: 1 / (1 + e^|g|), mirrored for g >= 0 (so e^x never
// overflows); the scalar loop and the AVX-512 loop's tail both.
inline float silu_gate_one(float g, float u) {
  const float y = 1.0f / (1.0f + std::exp(std::fabs(g)));
  return g * (g < 0.0f ? y : 1.0f - y) * u;
}

#if defined(__x86_64__)

// Eight lanes over the dims (the tail scalar), summed lane by lane in a fixed tree.
MLXINFER_AVX2 float dot_avx2(const float* a, const float* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  }
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  __m128 pairs = _mm_add_ps(h, _mm_movehl_ps(h, h));
  float sum = _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
  for (; i < n; ++i) {
    sum += a[i] * b[i];
  }
  return sum;
}

MLXINFER_AVX2 void axpy_avx2(float p, const float* v, float* acc, int n) {
  const __m256 pv = _mm256_set1_ps(p);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
  }
  for (; i < n; ++i) {
    acc[i] += p * v[i];
  }
}

// Horizontal sum of dot_avx2's accumulator plus its scalar tail, in dot_avx2's order.
MLXINFER_AVX2 inline float finish_dot(__m256 acc, const float* a, const float* b, int from, int n) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  __m128 pairs = _mm_add_ps(h, _mm_movehl_ps(h, h));
  float sum = _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
  for (int i = from; i < n; ++i) {
    sum += a[i] * b[i];
  }
  return sum;
}

// R rows of x against NO rows of w: R * NO independent dot_avx2 chains side by side, so the
// products are not bound by one chain's latency, each equal to dot_avx2 bit for bit.
template <int R, int NO>
MLXINFER_AVX2 void float_tile_avx2(const float* x, const float* w, int in, float* y, int out) {
  __m256 acc[R][NO];
  for (int r = 0; r < R; ++r) {
    for (int o = 0; o < NO; ++o) {
      acc[r][o] = _mm256_setzero_ps();
    }
  }
  int k = 0;
  for (; k + 8 <= in; k += 8) {
    __m256 wv[NO];
    for (int o = 0; o < NO; ++o) {
      wv[o] = _mm256_loadu_ps(w + static_cast<size_t>(o) * in + k);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + static_cast<size_t>(r) * in + k);
      for (int o = 0; o < NO; ++o) {
        acc[r][o] = _mm256_fmadd_ps(xv, wv[o], acc[r][o]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int o = 0; o < NO; ++o) {
      y[static_cast<size_t>(r) * out + o] =
          finish_dot(acc[r][o], x + static_cast<size_t>(r) * in, w + static_cast<size_t>(o) * in, k, in);
    }
  }
}

// Rows two at a time against outputs four at a time (remainders by smaller tiles).
MLXINFER_AVX2 void float_matmul_avx2(const float* w, int in, const float* x, int rows, float* y, int out, int n0,
                                     int n1) {
  for (int n = n0; n < n1; n += 4) {
    const int outputs = std::min(4, n1 - n);
    const float* wn = w + static_cast<size_t>(n) * in;
    for (int r = 0; r < rows; r += 2) {
      const float* xr = x + static_cast<size_t>(r) * in;
      float* yr = y + static_cast<size_t>(r) * out + n;
      const bool pair = r + 1 < rows;
      switch (outputs) {
        case 4: pair ? float_tile_avx2<2, 4>(xr, wn, in, yr, out) : float_tile_avx2<1, 4>(xr, wn, in, yr, out); break;
        case 3: pair ? float_tile_avx2<2, 3>(xr, wn, in, yr, out) : float_tile_avx2<1, 3>(xr, wn, in, yr, out); break;
        case 2: pair ? float_tile_avx2<2, 2>(xr, wn, in, yr, out) : float_tile_avx2<1, 2>(xr, wn, in, yr, out); break;
        default: pair ? float_tile_avx2<2, 1>(xr, wn, in, yr, out) : float_tile_avx2<1, 1>(xr, wn, in, yr, out);
      }
    }
  }
}

// e^x for 16 floats: x = n ln 2 + r, e^r by Cephes' expf polynomial, times 2^n (scalef, which
// goes to 0 below the smallest float). Inputs are clamped first, so -inf gives 0, not NaN.
MLXINFER_AVX512 inline __m512 exp_avx512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

MLXINFER_AVX512 void silu_gate_avx512(const float* g, const float* u, float* a, int n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 y = _mm512_div_ps(one, _mm512_add_ps(one, exp_avx512(_mm512_abs_ps(x))));
    const __m512 s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ),
                                          _mm512_sub_ps(one, y), y);
    _mm512_storeu_ps(a + i, _mm512_mul_ps(_mm512_mul_ps(x, s), _mm512_loadu_ps(u + i)));
  }
  for (; i < n; ++i) {
    a[i] = silu_gate_one(g[i], u[i]);
  }
}

MLXINFER_AVX512 float logsumexp_avx512(const float* x, int n) {
  const __m512 lowest = _mm512_set1_ps(-INFINITY);
  __m512 top = lowest;
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    top = _mm512_max_ps(top, _mm512_loadu_ps(x + i));
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
  top = _mm512_max_ps(top, _mm512_mask_loadu_ps(lowest, tail, x + i));
  const float m = _mm512_reduce_max_ps(top);
  if (m == -INFINITY) {
    return m;
  }
  const __m512 shift = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) {
    sum = _mm512_add_ps(sum, exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i), shift)));
  }
  sum = _mm512_mask_add_ps(sum, tail, sum, exp_avx512(_mm512_sub_ps(_mm512_mask_loadu_ps(shift, tail, x + i), shift)));
  return m + std::log(_mm512_reduce_add_ps(sum));
}

#endif

} // namespace

void silu_gate(const float* g, const float* u, float* a, int n) {
#if defined(__x86_64__)
  if (simd_avx512()) {
    return silu_gate_avx512(g, u, a, n);
  }
#endif
  for (int i = 0; i < n; ++i) {
    a[i] = silu_gate_one(g[i], u[i]);
  }
}

float logsumexp(const float* x, int n) {
#if defined(__x86_64__)
  if (simd_avx512()) {
    return logsumexp_avx512(x, n);
  }
#endif
  float m = -INFINITY;
  for (int i = 0; i < n; ++i) {
    m = std::max(m, x[i]);
  }
  if (m == -INFINITY) {
    return m;
  }
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    sum += std::exp(x[i] - m);
  }
  return m + std::log(sum);
}

void axpy(float p, const float* v, float* acc, int n) {
#if defined(__x86_64__)
  if (simd_avx2()) {
    return axpy_avx2(p, v, acc, n);
  }
#endif
  axpy_scalar(p, v, acc, n);
}

float dot(const float* a, const float* b, int n) {
#if defined(__x86_64__)
  if (simd_avx2()) {
    return dot_avx2(a, b, n);
  }
#endif
  return dot_scalar_loop(a, b, n);
}

void float_matmul_range(const float* w, int in, const float* x, int rows, float* y, int out, int n0, int n1) {
#if defined(__x86_64__)
  if (simd_avx2()) {
    return float_matmul_avx2(w, in, x, rows, y, out, n0, n1);
  }
#endif
  for (int n = n0; n < n1; ++n) {
    const float* wn = w + static_cast<size_t>(n) * in;
    for (int r = 0; r < rows; ++r) {
      y[static_cast<size_t>(r) * out + n] = dot(x + static_cast<size_t>(r) * in, wn, in);
    }
  }
}

void decode_attention_head(const float* q, const CachedHeads& keys, const CachedHeads& values, int kv_head,
                           int length, int dims, float scale, float* out, float* scores) {
#if defined(__x86_64__)
  const bool avx2 = simd_avx2();
#else
  const bool avx2 = false;
#endif
  const float* k = keys.data + kv_head * keys.head_stride;
  const float* v = values.data + kv_head * values.head_stride;
  float top = -INFINITY;
  for (int j = 0; j < length; ++j) {
    const float* kj = k + j * keys.slot_stride;
#if defined(__x86_64__)
    const float s = (avx2 ? dot_avx2(q, kj, dims) : dot_scalar_loop(q, kj, dims)) * scale;
#else
    const float s = dot_scalar_loop(q, kj, dims) * scale;
#endif
    scores[j] = s;
    top = std::max(top, s);
  }
  float total = 0.0f;
  for (int j = 0; j < length; ++j) {
    scores[j] = std::exp(scores[j] - top);
    total += scores[j];
  }
  std::fill(out, out + dims, 0.0f);
  for (int j = 0; j < length; ++j) {
    const float* vj = v + j * values.slot_stride;
#if defined(__x86_64__)
    if (avx2) {
      axpy_avx2(scores[j], vj, out, dims);
      continue;
    }
#endif
    axpy_scalar(scores[j], vj, out, dims);
  }
  for (int d = 0; d < dims; ++d) {
    out[d] /= total;
  }
}

} // namespace mlxinfer
