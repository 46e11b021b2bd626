// The x86-64 vector loops' target attributes, one feature list for every file: a function so
// marked runs only where kernel.cpp's active() found those features (simd_avx2() and
// simd_avx512() say so), and functions of the same list inline into one another.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#define MLXINFER_AVX2 __attribute__((target("avx2,fma,f16c")))
#define MLXINFER_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#endif
