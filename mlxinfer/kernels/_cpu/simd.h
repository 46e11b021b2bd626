// The x86-64 vector loops' target attributes, one feature list for every file: a function so
// marked runs only where kernel.cpp's active() found those features (simd_avx2() and
// simd_avx512() say so), and functions of the same list inline into one another.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#define MLXINFER_AVX2 __attribute__((target("avx2,fma,f16c")))
#define MLXINFER_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

// The same lists for a region of code: every function defined between a BEGIN and
// MLXINFER_TARGET_END, templates included, is compiled for them (one source for several loops).
#if defined(__clang__)
#define MLXINFER_AVX2_BEGIN \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c\"))), apply_to = function)")
#define MLXINFER_AVX512_BEGIN \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx2,fma,f16c\"))), apply_to = function)")
#define MLXINFER_TARGET_END _Pragma("clang attribute pop")
#else
#define MLXINFER_AVX2_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define MLXINFER_AVX512_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx2,fma,f16c\")")
#define MLXINFER_TARGET_END _Pragma("GCC pop_options")
#endif
#endif
