// What the primitives of primitive.cpp and layer.cpp share: the thread pool, how work is
// cut into chunks, and reading MLX arrays as row-major buffers.
#pragma once

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

ScaleType scale_type(mx::Dtype dtype);

// The array's data as a row-major buffer, copied into `keep` only if it is strided.
const void* row_major(const mx::array& a, std::vector<uint8_t>& keep);

std::string shape_text(const mx::array& a);

// A float32 cache buffer [1, kv_heads, slots, dims] as attention reads it: in place when its dims
// are contiguous, else copied row major into `keep`.
CachedHeads cached_heads(const mx::array& c, std::vector<uint8_t>& keep);

} // namespace mlxinfer
