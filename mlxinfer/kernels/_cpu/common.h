// What the primitives of primitive.cpp and layer.cpp share: the thread pool, how work is
// cut into chunks, and reading MLX arrays as row-major buffers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "mlx/array.h"

#include "kernel.h"
#include "pool.h"

namespace mlxinfer {

namespace mx = mlx::core;

// Below this many weights one thread is quicker than waking another.
constexpr size_t kSplitFrom = 1 << 16;
// Outputs per chunk are a multiple of this, so two threads never share a cache line of y.
constexpr int kOutputAlign = 16;
// Chunks per thread: enough that a late or slow thread leaves little for the others to wait on.
constexpr int kChunksPerThread = 4;

// The one pool every primitive splits its work across (sized to the CPUs this process may use).
Pool& pool();

// Outputs per chunk for an [out, in] product: all of them below kSplitFrom weights.
int output_chunk(int out, int in);

// A product of `rows` rows by an [out, in] matrix cut into the pool's tasks: task t computes rows
// [r0, r1) for outputs [n0, n1). Up to kGemmRows rows, chunks of outputs (output_chunk) for all
// rows; from there, blocks of rows (gemm_block_rows, whose inputs stay in L2) by chunks of outputs,
// so no thread packs every row's inputs for its outputs. Any cut gives the same bits per row.
struct ProductTasks {
  struct Range {
    int r0, r1, n0, n1;
  };
  int rows, out, row_block, output_chunk;

  int count() const {
    return (rows + row_block - 1) / row_block * ((out + output_chunk - 1) / output_chunk);
  }
  Range at(int t) const {
    const int chunks = (out + output_chunk - 1) / output_chunk;
    const int r0 = t / chunks * row_block, n0 = t % chunks * output_chunk;
    return {r0, std::min(rows, r0 + row_block), n0, std::min(out, n0 + output_chunk)};
  }
};

ProductTasks product_tasks(int rows, int out, int in);

ScaleType scale_type(mx::Dtype dtype);

// The array's data as a row-major buffer, copied into `keep` only if it is strided.
const void* row_major(const mx::array& a, std::vector<uint8_t>& keep);

std::string shape_text(const mx::array& a);

// A float32 cache buffer [1, kv_heads, slots, dims] as attention reads it: in place when its dims
// are contiguous, else copied row major into `keep`.
CachedHeads cached_heads(const mx::array& c, std::vector<uint8_t>& keep);

} // namespace mlxinfer
