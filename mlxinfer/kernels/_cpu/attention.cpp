// Attention over float32 K/V caches (see kernel.h), and the float32 loops the layer primitives
// share with it: dot products, the float matmul, axpy, the SwiGLU gate and logsumexp.
//
// Attention is tiled as FlashAttention is, for a prompt chunk (many queries) and a decode step
// (one per head) alike: for each KV head, the query heads of its group and the chunk's positions
// share every block of keys and values as it is read, with an online softmax, so the score matrix
// is never written out. The key blocks lie at fixed slots from slot 0 and each query's arithmetic
// (attention_loop.h) does not depend on which tile, thread, batch or call computes it: a sequence
// gets the same numbers alone or batched, and a position the same whether it comes in a prompt
// chunk or a decode step. Long contexts are cut into segments merged in order, so a decode step
// can spread one KV head's keys over the threads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "kernel.h"
#include "pool.h"
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

namespace {

// Keys per online-softmax step, and per segment (merged in order; a multiple of the block).
constexpr int kKeyBlock = 32;
constexpr int kSegment = 256;
// Below this, e^x is under the smallest normal float, a term under 2^-126 of the largest one: 0.
constexpr float kExpFloor = -87.0f;
// The most queries a loop's tile holds, and the queries of one task of a prompt chunk (they
// share each segment's transposed keys).
constexpr int kMaxTile = 8;
constexpr int kStateLanes = 16;
constexpr int kGroupQueries = 96;
// Below this many multiply-adds a call runs on the calling thread alone.
constexpr int64_t kParallelFrom = 1 << 16;

// a > b ? a : b, the vector max instructions' rule (a NaN or equal zeros give b).
inline float larger(float a, float b) {
  return a > b ? a : b;
}

inline float float_from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The queries of one row that read one KV head: query i is position i / group of the chunk, head
// kv_head * group + i % group; position t sits at slot length - tokens + t and attends the slots
// [lo, hi) up to itself (the last `window` of them when window > 0).
struct Group {
  const float* q;        // the row's queries [heads, tokens, dims]
  const float* k;        // this KV head's keys: slot j at k + j * k_stride
  const float* v;
  int64_t k_stride, v_stride;
  float* out;            // the row's output: position t, head h at out + t * out_token + h * out_head
  int64_t out_token, out_head;
  int kv_head, group, tokens, length, window, dims;
  float scale;

  int hi(int i) const {
    return length - tokens + i / group + 1;
  }
  int lo(int i) const {
    return window > 0 ? std::max(0, hi(i) - window) : 0;
  }
  int head(int i) const {
    return kv_head * group + i % group;
  }
  const float* query(int i) const {
    return q + (static_cast<int64_t>(head(i)) * tokens + i / group) * dims;
  }
  float* output(int i) const {
    return out + (i / group) * out_token + head(i) * out_head;
  }
};

// One tile's working rows: q' [tile, dims], scores then p [tile, kKeyBlock], o [tile, dims], and
// each query's running max m, sum l, this block's max top and carry c (kStateLanes each, so a
// loop may read a whole vector of them).
struct TileState {
  float *q, *s, *o, *m, *l, *top, *c;
};

// A thread's buffers, kept between calls.
struct Scratch {
  std::vector<float> kt, rows, part, total;

  float* keys(int dims) {
    kt.resize(static_cast<size_t>(kSegment) * dims);
    return kt.data();
  }
  TileState tile(int dims) {
    rows.resize(static_cast<size_t>(kMaxTile) * (2 * dims + kKeyBlock) + 4 * kStateLanes);
    TileState t;
    t.q = rows.data();
    t.o = t.q + kMaxTile * dims;
    t.s = t.o + kMaxTile * dims;
    t.m = t.s + kMaxTile * kKeyBlock;
    t.l = t.m + kStateLanes;
    t.top = t.l + kStateLanes;
    t.c = t.top + kStateLanes;
    return t;
  }
};

Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

// A query's state over no keys: o = 0, m = -inf, l = 0 (merging it changes nothing).
inline void empty_state(float* state, int dims) {
  std::fill_n(state, dims, 0.0f);
  state[dims] = -INFINITY;
  state[dims + 1] = 0.0f;
}

// kt [blocks, dims, kKeyBlock] = keys [keys, dims] (slot j at k + j * stride) transposed block by
// block, the last block's missing keys zero; plain copies, so any loop may do it.
void transpose_scalar(const float* k, int64_t stride, int keys, int dims, float* kt, int from = 0) {
  const int padded = (keys + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  for (int j = from; j < padded; ++j) {
    float* column = kt + static_cast<int64_t>(j / kKeyBlock) * dims * kKeyBlock + j % kKeyBlock;
    for (int d = 0; d < dims; ++d) {
      column[d * kKeyBlock] = j < keys ? k[j * stride + d] : 0.0f;
    }
  }
}

// The one-lane "vector": the scalar loop, and the model the vector loops follow lane by lane.
struct ScalarOps {
  using V = float;
  static constexpr int N = 1, kTile = kMaxTile, kScoreVectors = 8, kValueQueries = 4, kValueVectors = 4;

  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V set1(float x) { return x; }
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }
  static V fnma(V a, V b, V c) { return std::fma(-a, b, c); }
  static V mul(V a, V b) { return a * b; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V div(V a, V b) { return a / b; }
  static V max(V a, V b) { return larger(a, b); }
  static V round(V x) { return std::nearbyint(x); }
  // 2^n for an integral n in [-126, 0] (anything else only where at_least discards it).
  static V pow2(V n) {
    return float_from_bits(static_cast<uint32_t>(n >= -126.0f ? static_cast<int>(n) + 127 : 0) << 23);
  }
  static V at_least(V x, float floor, V y) { return x >= floor ? y : 0.0f; }
  // s in the lanes [from, to) (relative to this vector's first key), -inf in the others.
  static V keep_lanes(V s, int from, int to) { return from <= 0 && 0 < to ? s : -INFINITY; }
  static float lane_max(V v) { return v; }
  static float halving_sum(V v) { return v; }
  static float first(V v) { return v; }
  static void transpose(const float* k, int64_t stride, int keys, int dims, float* kt) {
    transpose_scalar(k, stride, keys, dims, kt);
  }
};

} // namespace

namespace scalar_loop {
namespace {
using Ops = ScalarOps;
inline float exp_scalar(float x);
#include "attention_loop.h"
inline float exp_scalar(float x) {
  return Ops::first(exp_nonpositive(Ops::set1(x)));
}
} // namespace
} // namespace scalar_loop

#if defined(__x86_64__)

MLXINFER_AVX2_BEGIN
namespace avx2_loop {
namespace {

// 8 rows of 8 floats transposed in registers: r[i] holds row i; afterwards column i.
inline void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m256 u[8]; // u[4g + c]: rows 4g..4g+3 of column c (low lane) and c + 4 (high lane)
  for (int g = 0; g < 2; ++g) {
    const __m256d a = _mm256_castps_pd(t[4 * g]), b = _mm256_castps_pd(t[4 * g + 2]);
    const __m256d c = _mm256_castps_pd(t[4 * g + 1]), d = _mm256_castps_pd(t[4 * g + 3]);
    u[4 * g] = _mm256_castpd_ps(_mm256_unpacklo_pd(a, b));
    u[4 * g + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a, b));
    u[4 * g + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(c, d));
    u[4 * g + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(c, d));
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[c + 4] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

struct Ops {
  using V = __m256;
  static constexpr int N = 8, kTile = 6, kScoreVectors = 2, kValueQueries = 3, kValueVectors = 4;

  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  static V at_least(V x, float floor, V y) {
    return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(floor), _CMP_GE_OQ), y);
  }
  static V keep_lanes(V s, int from, int to) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i keep = _mm256_and_si256(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(from - 1)),
                                          _mm256_cmpgt_epi32(_mm256_set1_epi32(to), lane));
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, _mm256_castsi256_ps(keep));
  }
  static float lane_max(V v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
  }
  static float halving_sum(V v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
  }
  static float first(V v) { return _mm256_cvtss_f32(v); }
  // Whole 8 x 8 tiles in registers, the rest (and the padding) by the plain copy.
  static void transpose(const float* k, int64_t stride, int keys, int dims, float* kt) {
    const int whole = keys / 8 * 8;
    for (int j = 0; j < whole; j += 8) {
      float* block = kt + static_cast<int64_t>(j / kKeyBlock) * dims * kKeyBlock + j % kKeyBlock;
      for (int d = 0; d + 8 <= dims; d += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) {
          r[i] = _mm256_loadu_ps(k + (j + i) * stride + d);
        }
        transpose8(r);
        for (int i = 0; i < 8; ++i) {
          _mm256_storeu_ps(block + (d + i) * kKeyBlock, r[i]);
        }
      }
    }
    transpose_scalar(k, stride, keys, dims, kt, whole);
  }
};

inline float exp_scalar(float x) {
  return scalar_loop::exp_scalar(x);
}
#include "attention_loop.h"

} // namespace
} // namespace avx2_loop
MLXINFER_TARGET_END

MLXINFER_AVX512_BEGIN
namespace avx512_loop {
namespace {

// 16 rows of 16 floats transposed in registers: r[i] holds row i; afterwards column i.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m512 u[16]; // u[4g + c]: in 128-bit lane L, rows 4g..4g+3 of column 4L + c
  for (int g = 0; g < 4; ++g) {
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * g + 1]), d = _mm512_castps_pd(t[4 * g + 3]);
    u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const __m512 w0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 w1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(v0, w0, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
    r[8 + c] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
  }
}

struct Ops {
  using V = __m512;
  static constexpr int N = 16, kTile = kMaxTile, kScoreVectors = 2, kValueQueries = 4, kValueVectors = 4;

  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
  static V at_least(V x, float floor, V y) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(floor), _CMP_GE_OQ), y);
  }
  static V keep_lanes(V s, int from, int to) {
    const unsigned b = static_cast<unsigned>(std::clamp(from, 0, 16)), e = static_cast<unsigned>(std::clamp(to, 0, 16));
    const auto keep = static_cast<__mmask16>(((1u << e) - 1u) & ~((1u << b) - 1u));
    return _mm512_mask_blend_ps(keep, _mm512_set1_ps(-INFINITY), s);
  }
  static float lane_max(V v) { return _mm512_reduce_max_ps(v); }
  static float halving_sum(V v) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    const __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
  }
  static float first(V v) { return _mm512_cvtss_f32(v); }
  // Whole 16 x 16 tiles in registers, the rest (and the padding) by the plain copy.
  static void transpose(const float* k, int64_t stride, int keys, int dims, float* kt) {
    const int whole = keys / 16 * 16;
    for (int j = 0; j < whole; j += 16) {
      float* block = kt + static_cast<int64_t>(j / kKeyBlock) * dims * kKeyBlock + j % kKeyBlock;
      for (int d = 0; d + 16 <= dims; d += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) {
          r[i] = _mm512_loadu_ps(k + (j + i) * stride + d);
        }
        transpose16(r);
        for (int i = 0; i < 16; ++i) {
          _mm512_storeu_ps(block + (d + i) * kKeyBlock, r[i]);
        }
      }
    }
    transpose_scalar(k, stride, keys, dims, kt, whole);
  }
};

inline float exp_scalar(float x) {
  return scalar_loop::exp_scalar(x);
}
#include "attention_loop.h"

} // namespace
} // namespace avx512_loop
MLXINFER_TARGET_END

#endif

namespace {

// One loop's entry points (attention_loop.h).
struct Loop {
  void (*segment)(const Group&, int, int, int, Scratch&, float*);
  void (*merge)(const float*, float*, int, int);
  void (*finish)(const Group&, const float*, int, int);
};

// The widest loop the CPU runs whose vectors divide the head dim (the others' bits are the same).
Loop loop_for(int dims) {
#if defined(__x86_64__)
  if (simd_avx512() && dims % avx512_loop::N == 0) {
    return {avx512_loop::segment, avx512_loop::merge, avx512_loop::finish};
  }
  if (simd_avx2() && dims % avx2_loop::N == 0) {
    return {avx2_loop::segment, avx2_loop::merge, avx2_loop::finish};
  }
#endif
  return {scalar_loop::segment, scalar_loop::merge, scalar_loop::finish};
}

// The segments whose keys queries [first, first + count) of `g` attend.
std::pair<int, int> segments_of(const Group& g, int first, int count) {
  return {g.lo(first) / kSegment, (g.hi(first + count - 1) - 1) / kSegment + 1};
}

} // namespace

void attention(const float* q, const CachedHeads* keys, const CachedHeads* values, const int* lengths, int rows,
               const AttentionShape& shape, const AttentionOutput& out, Pool& pool) {
  const Loop loop = loop_for(shape.dims);
  const int dims = shape.dims, stride = dims + 2, group = shape.heads / shape.kv_heads;
  const int per_head = group * shape.tokens;  // queries per (row, KV head)
  const int groups = (per_head + kGroupQueries - 1) / kGroupQueries;
  const int size = (per_head + groups - 1) / groups;
  auto make = [&](int r, int kv) {
    const int64_t row_q = static_cast<int64_t>(r) * shape.heads * shape.tokens * dims;
    return Group{q + row_q,
                 keys[r].data + kv * keys[r].head_stride,
                 values[r].data + kv * values[r].head_stride,
                 keys[r].slot_stride,
                 values[r].slot_stride,
                 out.data + r * out.row,
                 out.token,
                 out.head,
                 kv,
                 group,
                 shape.tokens,
                 lengths[r],
                 shape.window,
                 dims,
                 shape.scale};
  };
  // Task t: row and KV head t % (rows * kv_heads), query group from the last (the most keys) down.
  const int pairs = rows * shape.kv_heads, tasks = pairs * groups;
  struct Task {
    Group g;
    int first, count;
  };
  auto task = [&](int t) {
    const int pair = t % pairs, index = groups - 1 - t / pairs, first = index * size;
    return Task{make(pair / shape.kv_heads, pair % shape.kv_heads), first, std::min(size, per_head - first)};
  };
  int64_t work = 0;
  int most_segments = 0;
  for (int r = 0; r < rows; ++r) {
    work += static_cast<int64_t>(lengths[r]) * shape.tokens * shape.heads * dims;
    most_segments = std::max(most_segments, (lengths[r] + kSegment - 1) / kSegment);
  }
  auto run = [&](int n, const std::function<void(int)>& fn) {
    if (work < kParallelFrom) {
      for (int i = 0; i < n; ++i) {
        fn(i);
      }
    } else {
      pool.run(n, fn);
    }
  };
  // A task's queries: the states of its segments (`state(segment)`) merged in order, then o / l.
  auto gather = [&](const Task& k, auto state) {
    Scratch& s = scratch();
    s.total.resize(static_cast<size_t>(k.count) * stride);
    for (int i = 0; i < k.count; ++i) {
      empty_state(s.total.data() + i * stride, dims);
    }
    const auto [from, to] = segments_of(k.g, k.first, k.count);
    for (int seg = from; seg < to; ++seg) {
      loop.merge(state(seg), s.total.data(), k.count, dims);
    }
    loop.finish(k.g, s.total.data(), k.first, k.count);
  };
  if (tasks >= 2 * pool.size() || most_segments == 1 || work < kParallelFrom) {
    // Enough tasks for the threads: each computes its segments one after the other.
    run(tasks, [&](int t) {
      const Task k = task(t);
      gather(k, [&](int seg) {
        Scratch& s = scratch();
        s.part.resize(static_cast<size_t>(k.count) * stride);
        loop.segment(k.g, seg, k.first, k.count, s, s.part.data());
        return s.part.data();
      });
    });
    return;
  }
  // Few tasks over long caches (a decode step): every segment its own task, then each task's
  // states merged here (a few queries' worth of work, not worth waking the threads again).
  std::vector<int> first_part(tasks + 1, 0);
  std::vector<std::pair<int, int>> parts;  // (task, segment)
  for (int t = 0; t < tasks; ++t) {
    const Task k = task(t);
    const auto [from, to] = segments_of(k.g, k.first, k.count);
    for (int seg = from; seg < to; ++seg) {
      parts.emplace_back(t, seg);
    }
    first_part[t + 1] = static_cast<int>(parts.size());
  }
  const std::unique_ptr<float[]> states(new float[parts.size() * size * stride]);
  run(static_cast<int>(parts.size()), [&](int p) {
    const Task k = task(parts[p].first);
    loop.segment(k.g, parts[p].second, k.first, k.count, scratch(), states.get() + p * size * stride);
  });
  for (int t = 0; t < tasks; ++t) {
    const Task k = task(t);
    const int from = segments_of(k.g, k.first, k.count).first;
    gather(k, [&](int seg) { return states.get() + (first_part[t] + seg - from) * size * stride; });
  }
}

} // namespace mlxinfer
