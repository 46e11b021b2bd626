// The quantized matmul loops: AVX-512 (4- and 8-bit) and AVX2/FMA ones chosen at run time
// on x86-64, and a scalar one everywhere. All compute the same float32 operations in the
// same order: per group, w = q * s + b (one fused multiply-add), then 32 running sums per
// row (4 vectors of 8 lanes or 2 of 16; which input feeds which sum: sum_of) of x * w,
// added up at the end in a fixed tree. So the scalar loop is a bit-exact model of the
// vector ones, and a machine's results do not depend on which of them it has.
//
// Why 32 sums: with 16 (two AVX2 vectors) and 32-input groups, each group's loop ran two
// steps and the CPU spent more on the loop than on the arithmetic (7.4 GMAC/s on one core
// of this project's Xeon, against 12.8 with 32 and 18.4 with AVX-512's 16-lane registers).
// The AVX-512 4-bit loop then looks each weight up in its group's table of 16 values
// (fma(q, s, b) for q = 0..15, the same bits) rather than converting and scaling it.
#include "kernel.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace mlxinfer {

namespace {

constexpr int kLanes = 8;
constexpr int kSums = 32;        // running sums per output (and inputs per step): 4 x 8 or 2 x 16 lanes
constexpr int kMaxBlockRows = 4; // rows sharing one unpacking of the weights

// The vector loops, widest first; `limit_simd` caps which may run (tests compare them).
enum class Simd : int { scalar = 0, avx2 = 1, avx512 = 2 };
std::atomic<int> simd_cap{static_cast<int>(Simd::avx512)};

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

// The 32 running sums of one output summed in one fixed tree, the one the vector loops'
// registers make natural: sum j with sum j + 16 (the two 16-lane halves), then j with j + 8,
// j with j + 4, and the last four as (0 + 2) + (1 + 3).
inline float tree_sum(const float a[kSums]) {
  float v[16], h[kLanes], q[4];
  for (int j = 0; j < 16; ++j) {
    v[j] = a[j] + a[j + 16];
  }
  for (int j = 0; j < kLanes; ++j) {
    h[j] = v[j] + v[j + kLanes];
  }
  for (int j = 0; j < 4; ++j) {
    q[j] = h[j] + h[j + 4];
  }
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// Which of the 32 running sums input i of a 32-input chunk feeds. 4-bit weights come two
// per byte, so a chunk's 16 bytes give their low nibbles (even inputs) to sums 0-15 and
// their high nibbles (odd inputs) to sums 16-31; other widths feed the sums in input order.
template <int BITS>
constexpr int sum_of(int i) {
  return BITS == 4 ? (i % 2) * 16 + i / 2 : i;
}

template <int BITS>
void rows_scalar(const QuantizedMatrix& m, const float* x, int rows, float* y, int n0, int n1) {
  const size_t row_bytes = static_cast<size_t>(m.in) * BITS / 8;
  const int groups = m.in / m.group;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* w = m.packed + n * row_bytes;
    for (int r = 0; r < rows; ++r) {
      const float* xr = x + static_cast<size_t>(r) * m.in;
      float acc[kSums] = {};
      for (int g = 0; g < groups; ++g) {
        float s = scale_at(m.scales, m.scale_type, static_cast<size_t>(n) * groups + g);
        float b = scale_at(m.biases, m.scale_type, static_cast<size_t>(n) * groups + g);
        for (int k = g * m.group; k < (g + 1) * m.group; k += kSums) {
          uint32_t q[kSums];
          for (int v = 0; v < kSums / kLanes; ++v) {
            unpack_scalar<BITS>(w + (k + v * kLanes) * BITS / 8, q + v * kLanes);
          }
          for (int i = 0; i < kSums; ++i) {
            float& a = acc[sum_of<BITS>(i)];
            a = std::fma(xr[k + i], std::fma(static_cast<float>(q[i]), s, b), a);
          }
        }
      }
      y[static_cast<size_t>(r) * m.out + n] = tree_sum(acc);
    }
  }
}

#if defined(__x86_64__)

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

// The 32 integers of inputs [k, k + 32) of a packed row as floats, q[v] feeding sums
// [8v, 8v + 8) (sum_of): for 4 bits, the low nibbles of bytes 0-7 and 8-15, then their high ones.
template <int BITS>
MLXINFER_AVX2 inline void unpack32_avx2(const uint8_t* w, int k, __m256 q[4]) {
  if constexpr (BITS == 4) {
    const uint8_t* p = w + k / 2;
    const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    const __m256i low = _mm256_set1_epi32(0xf);
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v0, low));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(v1, low));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));
  } else {
    for (int v = 0; v < 4; ++v) {
      q[v] = unpack_avx2<BITS>(w + (k + v * kLanes) * BITS / 8);
    }
  }
}

// Scale or bias `index` as a float, with the CPU's half conversion (F16C comes with AVX2).
MLXINFER_AVX2 inline float scale_at_avx2(const void* data, ScaleType type, size_t index) {
  if (type == ScaleType::float16) {
    return _cvtsh_ss(static_cast<const uint16_t*>(data)[index]);
  }
  return scale_at(data, type, index);
}

// The scales and biases of rows [n, n + count) as floats, converted once for all of them:
// converting each group's pair where it is used cost a third of the 4-bit loop's time with
// half scales, and converting row by row still a twentieth (a short tail every row).
MLXINFER_AVX2 void row_scales(const QuantizedMatrix& m, int n, int count, float* s, float* b) {
  const size_t first = static_cast<size_t>(n) * (m.in / m.group);
  const int total = count * (m.in / m.group);
  if (m.scale_type == ScaleType::float32) {
    std::memcpy(s, static_cast<const float*>(m.scales) + first, total * sizeof(float));
    std::memcpy(b, static_cast<const float*>(m.biases) + first, total * sizeof(float));
    return;
  }
  int g = 0;
  if (m.scale_type == ScaleType::float16) {
    const uint16_t* hs = static_cast<const uint16_t*>(m.scales) + first;
    const uint16_t* hb = static_cast<const uint16_t*>(m.biases) + first;
    for (; g + kLanes <= total; g += kLanes) {
      _mm256_storeu_ps(s + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hs + g))));
      _mm256_storeu_ps(b + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hb + g))));
    }
  }
  for (; g < total; ++g) {
    s[g] = scale_at_avx2(m.scales, m.scale_type, first + g);
    b[g] = scale_at_avx2(m.biases, m.scale_type, first + g);
  }
}

// row_scales with AVX-512's 16-wide conversion of half scales (half the instructions: with
// 32-input groups the conversion is a twentieth of the 4-bit loop's work).
MLXINFER_AVX512 void row_scales_avx512(const QuantizedMatrix& m, int n, int count, float* s, float* b) {
  const int groups = m.in / m.group;
  if (m.scale_type != ScaleType::float16 || (count * groups) % 16 != 0) {
    return row_scales(m, n, count, s, b);
  }
  const size_t first = static_cast<size_t>(n) * groups;
  const uint16_t* hs = static_cast<const uint16_t*>(m.scales) + first;
  const uint16_t* hb = static_cast<const uint16_t*>(m.biases) + first;
  for (int g = 0; g < count * groups; g += 16) {
    _mm512_storeu_ps(s + g, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hs + g))));
    _mm512_storeu_ps(b + g, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hb + g))));
  }
}

// Outputs whose scales are converted together (row_scales).
constexpr int kScaleRows = 16;

// Room for kScaleRows rows' scales and biases (this thread's, reused).
inline float* scale_buffer(int groups) {
  thread_local std::vector<float> buffer;
  const size_t size = 2 * static_cast<size_t>(kScaleRows) * groups;
  if (buffer.size() < size) {
    buffer.resize(size);
  }
  return buffer.data();
}

// tree_sum over sums held as (lo, hi) = (sums 0-7 + 16-23, sums 8-15 + 24-31), lane-wise.
MLXINFER_AVX2 inline float tree_sum_avx2(__m256 lo, __m256 hi) {
  __m256 v = _mm256_add_ps(lo, hi);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 pairs = _mm_add_ps(h, _mm_movehl_ps(h, h)); // h0 + h2, h1 + h3
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

MLXINFER_AVX2 inline float tree_sum_avx2(const __m256 a[4]) {
  return tree_sum_avx2(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]));
}

// Rows ahead of the one being multiplied whose weights are fetched into L1 now: a decode
// step streams ~60 MB of weights from L3 or memory, and the hardware prefetcher alone left
// one core at ~10 GMAC/s where fetching 8 rows ahead gave ~12 (this project's Xeon).
constexpr int kPrefetchRows = 8;

inline void prefetch_row(const uint8_t* row, size_t bytes) {
  for (size_t off = 0; off < bytes; off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(row + off), _MM_HINT_T0);
  }
}

using ConvertScales = void (*)(const QuantizedMatrix&, int, int, float*, float*);

// Where a block loop's row n starts: its scales and biases (converted kScaleRows rows at a time
// by `convert` into `scales`, room for kScaleRows rows of each) once the weights kPrefetchRows
// rows ahead are on their way.
inline std::pair<const float*, const float*> start_row(const QuantizedMatrix& m, int n, int n0, int n1,
                                                       size_t row_bytes, float* scales, ConvertScales convert) {
  const int groups = m.in / m.group;
  float* biases = scales + kScaleRows * groups;
  if ((n - n0) % kScaleRows == 0) {
    convert(m, n, std::min(kScaleRows, n1 - n), scales, biases);
  }
  if (n + kPrefetchRows < n1) {
    prefetch_row(m.packed + (n + kPrefetchRows) * row_bytes, row_bytes);
  }
  const size_t at = static_cast<size_t>((n - n0) % kScaleRows) * groups;
  return {scales + at, biases + at};
}

// R rows (1..4) against outputs [n0, n1): each 32 weights are unpacked once for all R.
template <int BITS, int R, int CHUNKS>
MLXINFER_AVX2 void block_avx2(const QuantizedMatrix& m, const float* x, float* y, int n0, int n1) {
  const size_t row_bytes = static_cast<size_t>(m.in) * BITS / 8;
  const int groups = m.in / m.group;
  float* const scales = scale_buffer(groups);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* w = m.packed + n * row_bytes;
    const auto [sf, bf] = start_row(m, n, n0, n1, row_bytes, scales, row_scales);
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < 4; ++v) {
        acc[r][v] = _mm256_setzero_ps();
      }
    }
    for (int g = 0; g < groups; ++g) {
      const __m256 s = _mm256_set1_ps(sf[g]);
      const __m256 b = _mm256_set1_ps(bf[g]);
      for (int c = 0; c < CHUNKS; ++c) {
        const int k = (g * CHUNKS + c) * kSums;
        __m256 q[4];
        unpack32_avx2<BITS>(w, k, q);
        for (int v = 0; v < 4; ++v) {
          const __m256 wv = _mm256_fmadd_ps(q[v], s, b);
          for (int r = 0; r < R; ++r) {
            const float* xr = x + static_cast<size_t>(r) * m.in + k + v * kLanes;
            acc[r][v] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), wv, acc[r][v]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      y[static_cast<size_t>(r) * m.out + n] = tree_sum_avx2(acc[r]);
    }
  }
}

// The 32 8-bit integers of inputs [k, k + 32) as floats, in input order (sums 0-15, 16-31).
MLXINFER_AVX512 inline void unpack32_8bit_avx512(const uint8_t* w, int k, __m512& q0, __m512& q1) {
  q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k))));
  q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k + 16))));
}

MLXINFER_AVX512 inline float tree_sum_avx512(__m512 a0, __m512 a1) {
  const __m512 v = _mm512_add_ps(a0, a1);
  return tree_sum_avx2(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// A group's 16 possible 4-bit weights, fma(q, s, b) for q = 0..15 (the bits the other loops
// compute), for the AVX-512 loops to look each weight up in rather than convert and scale it.
MLXINFER_AVX512 inline __m512 group_table(__m512 s, __m512 b) {
  return _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), s, b);
}

// The 32 4-bit weights of inputs [k, k + 32) looked up in their group's table: w0 from the low
// nibbles of the chunk's 16 bytes (even inputs, sums 0-15), w1 from the high ones (odd, 16-31).
MLXINFER_AVX512 inline void lookup32(const uint8_t* w, int k, __m512 table, __m512& w0, __m512& w1) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k / 2)));
  w0 = _mm512_permutexvar_ps(v, table);  // reads each lane's low 4 bits: the low nibble
  w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}

// The AVX-512 loop for 4- and 8-bit weights: the same 32 sums as two 16-lane registers
// (sums 0-15, 16-31), each updated by the same operations in the same order, so its
// results equal block_avx2's bit for bit at about 1.5x its speed.
template <int BITS, int R, int CHUNKS>
MLXINFER_AVX512 void block_avx512(const QuantizedMatrix& m, const float* x, float* y, int n0, int n1) {
  const size_t row_bytes = static_cast<size_t>(m.in) * BITS / 8;
  const int groups = m.in / m.group;
  float* const scales = scale_buffer(groups);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* w = m.packed + n * row_bytes;
    const auto [sf, bf] = start_row(m, n, n0, n1, row_bytes, scales, row_scales_avx512);
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    }
    for (int g = 0; g < groups; ++g) {
      const __m512 s = _mm512_set1_ps(sf[g]);
      const __m512 b = _mm512_set1_ps(bf[g]);
      const __m512 table = group_table(s, b);
      for (int c = 0; c < CHUNKS; ++c) {
        const int k = (g * CHUNKS + c) * kSums;
        __m512 w0, w1;
        if constexpr (BITS == 4) {  // look each weight up: no convert, no multiply-add
          lookup32(w, k, table, w0, w1);
        } else {
          __m512 q0, q1;
          unpack32_8bit_avx512(w, k, q0, q1);
          w0 = _mm512_fmadd_ps(q0, s, b);
          w1 = _mm512_fmadd_ps(q1, s, b);
        }
        for (int r = 0; r < R; ++r) {
          const float* xr = x + static_cast<size_t>(r) * m.in + k;
          acc[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), w0, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w1, acc[r][1]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      y[static_cast<size_t>(r) * m.out + n] = tree_sum_avx512(acc[r][0], acc[r][1]);
    }
  }
}

// ---- Many rows: a cache-blocked product ----
//
// From kGemmRows rows the weights are dequantized once per block of rows (fma(q, s, b), the bits the
// block loops multiply by) and tiles of rows run against them. Each (row, output) keeps its 32 sums,
// fed and added up as above, but a tile runs the whole input once per slice of the sums a register
// holds (sums 0-15, then 16-31 with AVX-512; four slices of 8 with AVX2), so a (row, output) pair
// takes one register, not the two or four of all 32 sums, and a tile of 4 rows by 4 outputs loads 8
// vectors per 16 multiply-adds. This project's Zen 5 loads one 512-bit vector a cycle: a 4 x 2 tile
// of whole sums (12 loads per 16 multiply-adds) ran at ~35% of its FMA peak, this one at ~85% with
// its data in L1.
//
// Both operands are packed slice by slice so that a pass reads two sequential streams: element
// (slice v, chunk c, item i, lane l) at ((v * chunks + c) * items + i) * lanes + l, lane l of slice v
// feeding sum v * lanes + l, the items being a tile's rows or a panel's kTileOutputs outputs.
//
// The packed inputs of a block of rows stay in L2 (kBlockBytes) while panels of outputs are
// dequantized one after another, each with one tile's inputs in L1 (kPanelBytes); past ~256 rows the
// inputs of all rows no longer stayed in L2 and the product slowed by a third. The pool splits a
// product's rows at these blocks (gemm_block_rows), so no thread packs more rows than its tasks use.

constexpr int kTileOutputs = 4;
constexpr int kBlockBytes = 512 << 10; // of L2 (1 MB a core here) for a block's packed inputs
constexpr int kPanelBytes = 40 << 10;  // of L1 (48 KB) for a panel beside a tile's inputs

// Rows per tile: 4 x 4 (row, output) registers of 16 lanes and the 4 rows' inputs fit AVX-512's 32
// registers; 3 x 4 of 8 lanes and 3 inputs fit AVX2's 16.
template <bool WIDE>
constexpr int kTileRows = WIDE ? 4 : 3;

// Keeps v in a register: the compiler otherwise folds its load into every multiply-add that uses it,
// loading a tile's input once per output, and the tile ran 1.6x slower, bound by loads.
MLXINFER_AVX512 inline void in_register(__m512& v) {
  asm("" : "+v"(v));
}

MLXINFER_AVX2 inline void in_register(__m256& v) {
  asm("" : "+x"(v));
}

// Where (slice v, chunk c, item i) of a packed operand with `items` items starts (see above).
inline size_t packed_at(int v, int c, int i, int chunks, int items, int lanes) {
  return ((static_cast<size_t>(v) * chunks + c) * items + i) * lanes;
}

// Rows [0, rows) of x packed tile by tile (kTileRows rows, the last tile the rest), tile t at
// out + t * in: each chunk's 32 inputs in the order the sums take them (sum_of), two permutes a
// chunk for 4 bits.
template <int BITS>
MLXINFER_AVX512 void pack_rows_avx512(const float* x, int in, int rows, float* out) {
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
  const int chunks = in / kSums;
  for (int t = 0; t < rows; t += kTileRows<true>) {
    const int items = std::min(kTileRows<true>, rows - t);
    float* tile = out + static_cast<size_t>(t) * in;
    for (int i = 0; i < items; ++i) {
      const float* row = x + static_cast<size_t>(t + i) * in;
      for (int c = 0; c < chunks; ++c) {
        __m512 a = _mm512_loadu_ps(row + c * kSums), b = _mm512_loadu_ps(row + c * kSums + 16);
        if constexpr (BITS == 4) {
          const __m512 even = _mm512_permutex2var_ps(a, evens, b);
          b = _mm512_permutex2var_ps(a, odds, b);
          a = even;
        }
        _mm512_storeu_ps(tile + packed_at(0, c, i, chunks, items, 16), a);
        _mm512_storeu_ps(tile + packed_at(1, c, i, chunks, items, 16), b);
      }
    }
  }
}

// The even then the odd elements of a, b (8 each): shuffled within 128-bit lanes, then the 64-bit
// pairs put in order.
MLXINFER_AVX2 inline __m256 evens_avx2(__m256 a, __m256 b) {
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xd8));
}

MLXINFER_AVX2 inline __m256 odds_avx2(__m256 a, __m256 b) {
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd)), 0xd8));
}

// pack_rows_avx512 in four slices of 8; for 4 bits, sums 0-7 take inputs 0, 2, .. 14, sums 8-15
// inputs 16 .. 30, sums 16-23 and 24-31 the odd ones.
template <int BITS>
MLXINFER_AVX2 void pack_rows_avx2(const float* x, int in, int rows, float* out) {
  const int chunks = in / kSums;
  for (int t = 0; t < rows; t += kTileRows<false>) {
    const int items = std::min(kTileRows<false>, rows - t);
    float* tile = out + static_cast<size_t>(t) * in;
    for (int i = 0; i < items; ++i) {
      const float* row = x + static_cast<size_t>(t + i) * in;
      for (int c = 0; c < chunks; ++c) {
        __m256 v[4];
        for (int j = 0; j < 4; ++j) {
          v[j] = _mm256_loadu_ps(row + c * kSums + j * kLanes);
        }
        if constexpr (BITS == 4) {
          const __m256 u[4] = {v[0], v[1], v[2], v[3]};
          v[0] = evens_avx2(u[0], u[1]);
          v[1] = evens_avx2(u[2], u[3]);
          v[2] = odds_avx2(u[0], u[1]);
          v[3] = odds_avx2(u[2], u[3]);
        }
        for (int j = 0; j < 4; ++j) {
          _mm256_storeu_ps(tile + packed_at(j, c, i, chunks, items, kLanes), v[j]);
        }
      }
    }
  }
}

// Chunk c of output i of a packed group of outputs: the weights of sums 0-15 (w0) and 16-31 (w1).
MLXINFER_AVX512 inline void store_chunk_avx512(float* part, int c, int i, int chunks, __m512 w0, __m512 w1) {
  _mm512_storeu_ps(part + packed_at(0, c, i, chunks, kTileOutputs, 16), w0);
  _mm512_storeu_ps(part + packed_at(1, c, i, chunks, kTileOutputs, 16), w1);
}

// Outputs [n, n + count) dequantized into a panel, kTileOutputs to a packed group (group j at
// panel + j * kTileOutputs * in), the group's missing outputs zeros: per chunk the weights of sums
// 0-15 and 16-31, each fma(q, s, b) (looked up for 4 bits, as the block loop does).
template <int BITS>
MLXINFER_AVX512 void dequantize_panel_avx512(const QuantizedMatrix& m, int n, int count, float* panel) {
  const size_t row_bytes = static_cast<size_t>(m.in) * BITS / 8;
  const int groups = m.in / m.group, chunks = m.in / kSums, per_group = m.group / kSums;
  const int padded = (count + kTileOutputs - 1) / kTileOutputs * kTileOutputs;
  for (int o = 0; o < padded; ++o) {
    float* part = panel + static_cast<size_t>(o / kTileOutputs) * kTileOutputs * m.in;
    const int i = o % kTileOutputs;
    if (o >= count) {
      for (int c = 0; c < chunks; ++c) {
        store_chunk_avx512(part, c, i, chunks, _mm512_setzero_ps(), _mm512_setzero_ps());
      }
      continue;
    }
    const uint8_t* w = m.packed + (n + o) * row_bytes;
    for (int g = 0; g < groups; ++g) {
      const size_t at = static_cast<size_t>(n + o) * groups + g;
      const __m512 s = _mm512_set1_ps(scale_at_avx2(m.scales, m.scale_type, at));
      const __m512 b = _mm512_set1_ps(scale_at_avx2(m.biases, m.scale_type, at));
      const __m512 table = group_table(s, b);
      for (int c = g * per_group; c < (g + 1) * per_group; ++c) {
        __m512 w0, w1;
        if constexpr (BITS == 4) {
          lookup32(w, c * kSums, table, w0, w1);
        } else if constexpr (BITS == 8) {
          unpack32_8bit_avx512(w, c * kSums, w0, w1);
          w0 = _mm512_fmadd_ps(w0, s, b);
          w1 = _mm512_fmadd_ps(w1, s, b);
        } else {  // other widths unpack 8 at a time: each half of a slice as AVX2 writes it
          __m256 q[4];
          unpack32_avx2<BITS>(w, c * kSums, q);
          for (int v = 0; v < 4; ++v) {
            _mm256_storeu_ps(part + packed_at(v / 2, c, i, chunks, kTileOutputs, 16) + v % 2 * kLanes,
                             _mm256_fmadd_ps(q[v], _mm512_castps512_ps256(s), _mm512_castps512_ps256(b)));
          }
          continue;
        }
        store_chunk_avx512(part, c, i, chunks, w0, w1);
      }
    }
  }
}

// dequantize_panel_avx512 in four slices of 8 (unpack32_avx2's vectors, in the order of the sums).
template <int BITS>
MLXINFER_AVX2 void dequantize_panel_avx2(const QuantizedMatrix& m, int n, int count, float* panel) {
  const size_t row_bytes = static_cast<size_t>(m.in) * BITS / 8;
  const int groups = m.in / m.group, chunks = m.in / kSums, per_group = m.group / kSums;
  const int padded = (count + kTileOutputs - 1) / kTileOutputs * kTileOutputs;
  for (int o = 0; o < padded; ++o) {
    float* part = panel + static_cast<size_t>(o / kTileOutputs) * kTileOutputs * m.in;
    const int i = o % kTileOutputs;
    const uint8_t* w = m.packed + (n + o) * row_bytes;
    for (int g = 0; g < groups; ++g) {
      const size_t at = static_cast<size_t>(n + o) * groups + g;
      const bool real = o < count;
      const __m256 s = _mm256_set1_ps(real ? scale_at_avx2(m.scales, m.scale_type, at) : 0.0f);
      const __m256 b = _mm256_set1_ps(real ? scale_at_avx2(m.biases, m.scale_type, at) : 0.0f);
      for (int c = g * per_group; c < (g + 1) * per_group; ++c) {
        __m256 q[4] = {};
        if (real) {
          unpack32_avx2<BITS>(w, c * kSums, q);
        }
        for (int v = 0; v < 4; ++v) {
          _mm256_storeu_ps(part + packed_at(v, c, i, chunks, kTileOutputs, kLanes), _mm256_fmadd_ps(q[v], s, b));
        }
      }
    }
  }
}

// tree_sum_avx512's last steps for 16 pairs at once: v[4 * o + r] holds pair (r, o)'s sums 0-15 plus
// 16-31, and lane 4 * r + o of the result its total. Each step adds lane j + half to lane j of every
// pair (half = 8, 4, 2, 1; the last two as (0 + 2) + (1 + 3)), with the pairs' halves gathered by
// shuffles so that one add serves several pairs: 45 operations where 16 tree_sum_avx512 took ~140, a
// sixth of a tile's time over 576 inputs.
MLXINFER_AVX512 inline __m512 tree_sums_avx512(const __m512 v[16]) {
  __m512 h[8], q[4], p[2];
  for (int i = 0; i < 8; ++i) {  // 256-bit halves of two pairs: [a lo, b lo] + [a hi, b hi]
    h[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit blocks of four pairs
    q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0xdd));
  }
  for (int i = 0; i < 2; ++i) {  // within blocks: lanes (0 + 2), (1 + 3)
    p[i] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * i], q[2 * i + 1], 0x44), _mm512_shuffle_ps(q[2 * i], q[2 * i + 1], 0xee));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], 0x88), _mm512_shuffle_ps(p[0], p[1], 0xdd));
}

// R rows (packed at x) by kTileOutputs outputs (packed at w): one pass over the input per slice,
// then each pair's two slices added up as tree_sum_avx512 does; y[r * out + o] for o < outputs.
template <int R>
MLXINFER_AVX512 void tile_avx512(const float* x, const float* w, int chunks, float* y, int out, int outputs) {
  __m512 first[R][kTileOutputs], acc[R][kTileOutputs];
  for (int v = 0; v < 2; ++v) {
    for (int r = 0; r < R; ++r) {
      for (int o = 0; o < kTileOutputs; ++o) {
        acc[r][o] = _mm512_setzero_ps();
      }
    }
    const float* xv = x + packed_at(v, 0, 0, chunks, R, 16);
    const float* wv = w + packed_at(v, 0, 0, chunks, kTileOutputs, 16);
    for (int c = 0; c < chunks; ++c, xv += R * 16, wv += kTileOutputs * 16) {
      __m512 xr[R];
      for (int r = 0; r < R; ++r) {
        xr[r] = _mm512_loadu_ps(xv + r * 16);
        in_register(xr[r]);
      }
      for (int o = 0; o < kTileOutputs; ++o) {
        const __m512 wo = _mm512_loadu_ps(wv + o * 16);
        for (int r = 0; r < R; ++r) {
          acc[r][o] = _mm512_fmadd_ps(xr[r], wo, acc[r][o]);
        }
      }
    }
    if (v == 0) {
      std::memcpy(first, acc, sizeof acc);
    }
  }
  __m512 pairs[kTileOutputs * 4];
  for (int o = 0; o < kTileOutputs; ++o) {
    for (int r = 0; r < 4; ++r) {
      pairs[o * 4 + r] = r < R ? _mm512_add_ps(first[r][o], acc[r][o]) : _mm512_setzero_ps();
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, tree_sums_avx512(pairs));
  for (int r = 0; r < R; ++r) {
    for (int o = 0; o < outputs; ++o) {
      y[static_cast<size_t>(r) * out + o] = sums[4 * r + o];
    }
  }
}

// tile_avx512 with four slices of 8 lanes, added up as tree_sum_avx2 does.
template <int R>
MLXINFER_AVX2 void tile_avx2(const float* x, const float* w, int chunks, float* y, int out, int outputs) {
  __m256 sums[4][R][kTileOutputs];
  for (int v = 0; v < 4; ++v) {
    __m256 acc[R][kTileOutputs];
    for (int r = 0; r < R; ++r) {
      for (int o = 0; o < kTileOutputs; ++o) {
        acc[r][o] = _mm256_setzero_ps();
      }
    }
    const float* xv = x + packed_at(v, 0, 0, chunks, R, kLanes);
    const float* wv = w + packed_at(v, 0, 0, chunks, kTileOutputs, kLanes);
    for (int c = 0; c < chunks; ++c, xv += R * kLanes, wv += kTileOutputs * kLanes) {
      __m256 xr[R];
      for (int r = 0; r < R; ++r) {
        xr[r] = _mm256_loadu_ps(xv + r * kLanes);
        in_register(xr[r]);
      }
      for (int o = 0; o < kTileOutputs; ++o) {
        const __m256 wo = _mm256_loadu_ps(wv + o * kLanes);
        for (int r = 0; r < R; ++r) {
          acc[r][o] = _mm256_fmadd_ps(xr[r], wo, acc[r][o]);
        }
      }
    }
    std::memcpy(sums[v], acc, sizeof acc);
  }
  for (int r = 0; r < R; ++r) {
    for (int o = 0; o < outputs; ++o) {
      const __m256 a[4] = {sums[0][r][o], sums[1][r][o], sums[2][r][o], sums[3][r][o]};
      y[static_cast<size_t>(r) * out + o] = tree_sum_avx2(a);
    }
  }
}

// A tile of `rows` (1 to kTileRows) packed rows.
template <bool WIDE>
void tile(int rows, const float* x, const float* w, int chunks, float* y, int out, int outputs) {
  if constexpr (WIDE) {
    switch (rows) {
      case 1: return tile_avx512<1>(x, w, chunks, y, out, outputs);
      case 2: return tile_avx512<2>(x, w, chunks, y, out, outputs);
      case 3: return tile_avx512<3>(x, w, chunks, y, out, outputs);
      default: return tile_avx512<4>(x, w, chunks, y, out, outputs);
    }
  } else {
    switch (rows) {
      case 1: return tile_avx2<1>(x, w, chunks, y, out, outputs);
      case 2: return tile_avx2<2>(x, w, chunks, y, out, outputs);
      default: return tile_avx2<3>(x, w, chunks, y, out, outputs);
    }
  }
}

// Outputs dequantized at once: as many (in fours) as fit in L1 beside one tile's inputs.
template <bool WIDE>
int panel_outputs(int in) {
  const int fit = kPanelBytes / (static_cast<int>(sizeof(float)) * in) - kTileRows<WIDE>;
  return std::max(kTileOutputs, fit / kTileOutputs * kTileOutputs);
}

template <int BITS, bool WIDE>
void gemm(const QuantizedMatrix& m, const float* x, int rows, float* y, int n0, int n1) {
  thread_local std::vector<float> inputs, weights;
  const int block = std::min(rows, gemm_block_rows(m.in)), panel = panel_outputs<WIDE>(m.in);
  const int chunks = m.in / kSums;
  inputs.resize(static_cast<size_t>(block) * m.in);
  weights.resize(static_cast<size_t>(panel) * m.in);
  for (int r0 = 0; r0 < rows; r0 += block) {
    const int count = std::min(block, rows - r0);
    if constexpr (WIDE) {
      pack_rows_avx512<BITS>(x + static_cast<size_t>(r0) * m.in, m.in, count, inputs.data());
    } else {
      pack_rows_avx2<BITS>(x + static_cast<size_t>(r0) * m.in, m.in, count, inputs.data());
    }
    for (int n = n0; n < n1; n += panel) {
      const int outputs = std::min(panel, n1 - n);
      if constexpr (WIDE) {
        dequantize_panel_avx512<BITS>(m, n, outputs, weights.data());
      } else {
        dequantize_panel_avx2<BITS>(m, n, outputs, weights.data());
      }
      for (int t = 0; t < count; t += kTileRows<WIDE>) {
        float* yt = y + static_cast<size_t>(r0 + t) * m.out + n;
        for (int j = 0; j < outputs; j += kTileOutputs) {
          tile<WIDE>(std::min(kTileRows<WIDE>, count - t), inputs.data() + static_cast<size_t>(t) * m.in,
                     weights.data() + static_cast<size_t>(j) * m.in, chunks, yt + j, m.out,
                     std::min(kTileOutputs, outputs - j));
        }
      }
    }
  }
}

// x with each 32-input chunk reordered as the 4-bit loops read it (see sum_of): its even inputs,
// then its odd ones. Two permutes a chunk where AVX-512 has them (done per chunk of outputs, this
// copy was ~3% of a decode step as a scalar loop).
MLXINFER_AVX512 void deinterleave_avx512(const float* x, float* out, size_t n) {
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
  for (size_t k = 0; k < n; k += kSums) {
    const __m512 a = _mm512_loadu_ps(x + k);
    const __m512 b = _mm512_loadu_ps(x + k + 16);
    _mm512_storeu_ps(out + k, _mm512_permutex2var_ps(a, evens, b));
    _mm512_storeu_ps(out + k + 16, _mm512_permutex2var_ps(a, odds, b));
  }
}

template <bool WIDE>
const float* deinterleaved(const float* x, int rows, int in) {
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(rows) * in);
  if constexpr (WIDE) {
    deinterleave_avx512(x, buffer.data(), buffer.size());
    return buffer.data();
  }
  for (size_t k = 0; k < buffer.size(); k += kSums) {
    for (int i = 0; i < kSums; ++i) {
      buffer[k + sum_of<4>(i)] = x[k + i];
    }
  }
  return buffer.data();
}

// Rows in blocks of up to kMaxBlockRows, the group's chunk count a constant of the loop.
template <int BITS, int R, bool WIDE>
void block(const QuantizedMatrix& m, const float* x, float* y, int n0, int n1) {
  const int chunks = m.group / kSums;
  if constexpr (WIDE) {
    chunks == 1   ? block_avx512<BITS, R, 1>(m, x, y, n0, n1)
    : chunks == 2 ? block_avx512<BITS, R, 2>(m, x, y, n0, n1)
                  : block_avx512<BITS, R, 4>(m, x, y, n0, n1);
  } else {
    chunks == 1   ? block_avx2<BITS, R, 1>(m, x, y, n0, n1)
    : chunks == 2 ? block_avx2<BITS, R, 2>(m, x, y, n0, n1)
                  : block_avx2<BITS, R, 4>(m, x, y, n0, n1);
  }
}

template <int BITS, bool WIDE>
void blocks(const QuantizedMatrix& m, const float* x, int rows, float* y, int n0, int n1) {
  for (int r0 = 0; r0 < rows; r0 += kMaxBlockRows) {
    const float* xb = x + static_cast<size_t>(r0) * m.in;
    float* yb = y + static_cast<size_t>(r0) * m.out;
    switch (rows - r0 < kMaxBlockRows ? rows - r0 : kMaxBlockRows) {
      case 1: block<BITS, 1, WIDE>(m, xb, yb, n0, n1); break;
      case 2: block<BITS, 2, WIDE>(m, xb, yb, n0, n1); break;
      case 3: block<BITS, 3, WIDE>(m, xb, yb, n0, n1); break;
      default: block<BITS, 4, WIDE>(m, xb, yb, n0, n1); break;
    }
  }
}

template <int BITS, bool WIDE>
void rows_vector(const QuantizedMatrix& m, const float* x, int rows, float* y, int n0, int n1) {
  if constexpr (BITS == 4) {
    x = deinterleaved<WIDE>(x, rows, m.in);
  }
  blocks<BITS, WIDE>(m, x, rows, y, n0, n1);
}

// The peak: kChains independent multiply-add chains in registers, enough to keep two FMA units of
// 4-5 cycles' latency busy (and few enough for AVX2's 16 registers beside the two constants).
constexpr int kChains = 12;

MLXINFER_AVX512 float fma_chains_avx512(long rounds) {
  __m512 acc[kChains];
  const __m512 m = _mm512_set1_ps(0.999f), a = _mm512_set1_ps(1e-3f);
  for (int c = 0; c < kChains; ++c) {
    acc[c] = _mm512_set1_ps(c + 0.5f);  // (1 would be a fixed point, folded by the compiler)
  }
  for (long i = 0; i < rounds; ++i) {
    for (int c = 0; c < kChains; ++c) {
      acc[c] = _mm512_fmadd_ps(acc[c], m, a);
    }
  }
  for (int c = 1; c < kChains; ++c) {
    acc[0] = _mm512_add_ps(acc[0], acc[c]);
  }
  return _mm512_reduce_add_ps(acc[0]);
}

MLXINFER_AVX2 float fma_chains_avx2(long rounds) {
  __m256 acc[kChains];
  const __m256 m = _mm256_set1_ps(0.999f), a = _mm256_set1_ps(1e-3f);
  for (int c = 0; c < kChains; ++c) {
    acc[c] = _mm256_set1_ps(c + 0.5f);
  }
  for (long i = 0; i < rounds; ++i) {
    for (int c = 0; c < kChains; ++c) {
      acc[c] = _mm256_fmadd_ps(acc[c], m, a);
    }
  }
  for (int c = 1; c < kChains; ++c) {
    acc[0] = _mm256_add_ps(acc[0], acc[c]);
  }
  return _mm_cvtss_f32(_mm256_castps256_ps128(acc[0]));
}

bool cpu_has(Simd level) {
  static const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f");
  return level == Simd::scalar || (level == Simd::avx2 && avx2) || (level == Simd::avx512 && avx512);
}

#else

bool cpu_has(Simd level) {
  return level == Simd::scalar;
}

#endif

Simd active() {
  const Simd cap = static_cast<Simd>(simd_cap.load(std::memory_order_relaxed));
  for (Simd level : {Simd::avx512, Simd::avx2}) {
    if (level <= cap && cpu_has(level)) {
      return level;
    }
  }
  return Simd::scalar;
}

template <int BITS>
void rows_for(const QuantizedMatrix& m, const float* x, int rows, float* y, int n0, int n1) {
#if defined(__x86_64__)
  const Simd level = active();
  if (level != Simd::scalar && rows >= kGemmRows) {  // every width's panel dequantizes with AVX2 at least
    return level == Simd::avx512 ? gemm<BITS, true>(m, x, rows, y, n0, n1) : gemm<BITS, false>(m, x, rows, y, n0, n1);
  }
  if (level == Simd::avx512 && (BITS == 4 || BITS == 8)) {
    return rows_vector<BITS, true>(m, x, rows, y, n0, n1);
  }
  if (level != Simd::scalar) {
    return rows_vector<BITS, false>(m, x, rows, y, n0, n1);
  }
#endif
  rows_scalar<BITS>(m, x, rows, y, n0, n1);
}

} // namespace

int gemm_block_rows(int in) {
  static_assert(kGemmRowsAlign % kTileRows<true> == 0 && kGemmRowsAlign % kTileRows<false> == 0);
  const int fit = kBlockBytes / (static_cast<int>(sizeof(float)) * in);
  return std::max(kGemmRowsAlign, fit / kGemmRowsAlign * kGemmRowsAlign);
}

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
  switch (active()) {
    case Simd::avx512: return "avx512";
    case Simd::avx2: return "avx2+fma";
    default: return "scalar";
  }
}

bool simd_avx2() {
  return active() != Simd::scalar;
}

double fma_flops(long rounds) {
  static std::atomic<float> sink;  // the chains' result, kept so they are not optimised away
#if defined(__x86_64__)
  switch (active()) {
    case Simd::avx512:
      sink.store(fma_chains_avx512(rounds), std::memory_order_relaxed);
      return 2.0 * 16 * kChains * rounds;
    case Simd::avx2:
      sink.store(fma_chains_avx2(rounds), std::memory_order_relaxed);
      return 2.0 * kLanes * kChains * rounds;
    default: break;
  }
#endif
  float acc = 0.5f;  // scalar loops: one chain's fused multiply-adds, a floor rather than a peak
  for (long i = 0; i < rounds; ++i) {
    acc = std::fma(acc, 0.999f, 1e-3f);
  }
  sink.store(acc, std::memory_order_relaxed);
  return 2.0 * rounds;
}

bool simd_avx512() {
  return active() == Simd::avx512;
}

bool limit_simd(const char* name) {
  const std::string level = name;
  Simd cap;
  if (level == "scalar") {
    cap = Simd::scalar;
  } else if (level == "avx2+fma") {
    cap = Simd::avx2;
  } else if (level == "avx512" || level == "best") {
    cap = Simd::avx512;
  } else {
    return false;
  }
  simd_cap.store(static_cast<int>(cap), std::memory_order_relaxed);
  return true;
}

} // namespace mlxinfer
