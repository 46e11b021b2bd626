// y = x @ dequantize(W).T for MLX's affine quantized format, on the CPU, for a few rows.
//
// Independent of MLX so it can be read (and tested) as plain C++: the primitive in
// primitive.cpp hands it raw pointers.
#pragma once

#include <cstdint>

namespace mlxinfer {

enum class ScaleType { float32, float16, bfloat16 };

// A quantized matrix [out, in] as mx.quantize lays it out: each row a little-endian
// bit stream of `bits`-bit integers q, and per group of `group` consecutive inputs a
// scale s and a bias b, so that the weight is q * s + b.
struct QuantizedMatrix {
  const uint8_t* packed;
  const void* scales;
  const void* biases;
  ScaleType scale_type;
  int out;
  int in;
  int bits;
  int group;
};

// The widths quantized_matmul_range has loops for.
constexpr bool supported_bits(int bits) {
  return bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8;
}

// The group sizes its loops handle: one, two or four 32-input chunks a group (the MLX-side
// checks of primitive.cpp and layer.cpp refuse any other before it is called).
constexpr bool supported_group(int group) {
  return group == 32 || group == 64 || group == 128;
}

// y[r, n] = sum_k x[r, k] * (q[n, k] * s[n, k / group] + b[n, k / group]) for rows r
// in [0, rows) and outputs n in [n0, n1); x is [rows, in] and y [rows, out], row major.
// Every output is accumulated in float32 in one fixed order that depends neither on
// `rows` nor on [n0, n1), so a row's result is the same whatever shares its batch.
void quantized_matmul_range(const QuantizedMatrix& m, const float* x, int rows, float* y, int n0, int n1);

// From this many rows quantized_matmul_range dequantizes the weights once per block of rows and
// multiplies them as a cache-blocked GEMM (the same operations in the same order per output).
constexpr int kGemmRows = 5;

// The rows of such a block for `in` inputs: as many as keep their inputs in L2, in whole tiles of
// rows (a multiple of kGemmRowsAlign). Callers that split a product's rows across threads split at
// such blocks.
constexpr int kGemmRowsAlign = 12;
int gemm_block_rows(int in);

// "avx512", "avx2+fma" or "scalar": the widest loop quantized_matmul_range runs on this
// CPU (AVX-512 for 4- and 8-bit weights; other widths take the AVX2 loop there).
const char* simd_name();

// Floating-point operations done by `rounds` rounds of independent multiply-add chains held in
// registers at the widest vector width in use: timed on every thread, the FLOP rate the products
// are measured against (their roofline).
double fma_flops(long rounds);

// Whether the AVX2 loops run (the CPU has them and `limit_simd` allows them).
bool simd_avx2();

// Whether the AVX-512 loops run (the CPU has them and `limit_simd` allows them).
bool simd_avx512();

// One sequence's cached keys or values: float32, entry (head h, slot j, dim d) at
// data[h * head_stride + j * slot_stride + d].
struct CachedHeads {
  const float* data;
  int64_t head_stride;
  int64_t slot_stride;
};

// The queries of an attention call: each row brings `tokens` new positions, the last `tokens` of
// its cache's live slots; position t of a row with `length` live slots sits at slot
// length - tokens + t and attends the slots up to itself (causal), only the last `window` of them
// when window > 0. Query head h reads KV head h / (heads / kv_heads).
struct AttentionShape {
  int heads = 0;
  int kv_heads = 0;
  int dims = 0;
  int tokens = 0;
  float scale = 0;
  int window = 0;
};

// Where attention writes: row r, position t, head h at data + r * row + t * token + h * head.
struct AttentionOutput {
  float* data;
  int64_t row;
  int64_t token;
  int64_t head;
};

class Pool;

// softmax(q . k_j * scale) . v_j for every row r (cache keys[r], values[r] with lengths[r] live
// slots), head and position of q [rows, heads, tokens, dims], over the slots each attends (see
// AttentionShape), split across `pool`. Tiled with an online softmax (attention.cpp); each
// query's arithmetic is fixed, the same whatever the batch, the tokens beside it and the loop
// (AVX-512, AVX2 and the scalar one give the same bits).
void attention(const float* q, const CachedHeads* keys, const CachedHeads* values, const int* lengths, int rows,
               const AttentionShape& shape, const AttentionOutput& out, Pool& pool);

// a . b over n floats in one fixed order (AVX2 lanes then a fixed tree where the CPU has
// them, else a plain loop).
float dot(const float* a, const float* b, int n);

// log(sum_i exp(x[i])) over n floats, shifted by their maximum (-inf when every x[i] is -inf;
// no NaN or +inf expected: the sampler's `finite` removed them). AVX-512 computes 16 exps at
// once (a polynomial within 2 ulp of expf); elsewhere std::exp one at a time.
float logsumexp(const float* x, int n);

// a[i] = g[i] * sigmoid(g[i]) * u[i] for i in [0, n): SwiGLU's gating, with MLX's sigmoid
// (1 / (1 + e^|g|), mirrored for g >= 0); AVX-512 takes 16 exps at once (as logsumexp does).
void silu_gate(const float* g, const float* u, float* a, int n);

// acc[i] += p * v[i] for i in [0, n) (one fused multiply-add each where the CPU has them).
void axpy(float p, const float* v, float* acc, int n);

// y[r, n] = x[r] . w[n] for a float32 w [out, in] and outputs n in [n0, n1), x [rows, in] and
// y [rows, out] row major: each output one `dot`, so a row's result never depends on its batch.
void float_matmul_range(const float* w, int in, const float* x, int rows, float* y, int out, int n0, int n1);

// Cap the loops at "scalar", "avx2+fma" or "avx512" ("best": no cap; the CPU still decides
// what it has); false for another name. For tests, which compare the loops bit for bit.
bool limit_simd(const char* name);

} // namespace mlxinfer
