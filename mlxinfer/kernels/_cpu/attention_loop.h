// One loop of the tiled attention of attention.cpp, written once over a lane type `Ops` (one float,
// 8 or 16 lanes; see attention.cpp): attention.cpp includes this file once per loop, inside that
// loop's namespace and target region, so every loop runs the same operations in the same order on
// each lane and the scalar loop gives the vector ones' bits. No include guard on purpose.
//
// The arithmetic each query gets, whatever tile, batch or call it is computed in (attention.cpp
// says why it is the same everywhere):
//   keys in segments of kSegment slots from slot 0, each in blocks of kKeyBlock slots;
//   per block: s_j = q' . k_j as one fused multiply-add chain over the dims (q' = q * scale), keys
//     outside the query's range set to -inf; top = max(m, max_j s_j); c = e(m - top);
//     p_j = e(s_j - top); l = fma(l, c, tree sum of p); o = o * c, then o = fma(p_j, v_j, o) in key order;
//   per segment: its (m, l, o) merged into the running total (merge); at the end o / l.
// e is exp_nonpositive (exp of x <= 0; 0 below kExpFloor and for NaN, the -inf - -inf of a query
// with no key yet).

using V = Ops::V;
constexpr int N = Ops::N;
static_assert(kKeyBlock % N == 0, "a key block is whole vectors");

// e^x for x <= 0 in every lane: x = n ln 2 + r, e^r by Cephes' expf polynomial (as exp_avx512),
// times 2^n built from its bits (n in [-126, 0] above the floor: a normal float).
inline V exp_nonpositive(V x) {
  const V n = Ops::round(Ops::mul(x, Ops::set1(1.44269504088896341f)));
  V r = Ops::fnma(n, Ops::set1(0.693359375f), x);
  r = Ops::fnma(n, Ops::set1(-2.12194440e-4f), r);
  V p = Ops::set1(1.9875691500e-4f);
  p = Ops::fma(p, r, Ops::set1(1.3981999507e-3f));
  p = Ops::fma(p, r, Ops::set1(8.3334519073e-3f));
  p = Ops::fma(p, r, Ops::set1(4.1665795894e-2f));
  p = Ops::fma(p, r, Ops::set1(1.6666665459e-1f));
  p = Ops::fma(p, r, Ops::set1(5.0000001201e-1f));
  const V y = Ops::fma(p, Ops::mul(r, r), Ops::add(r, Ops::set1(1.0f)));
  return Ops::at_least(x, kExpFloor, Ops::mul(y, Ops::pow2(n)));
}

// A block's kKeyBlock values (in kKeyBlock / N vectors, key order) summed by halving: value k plus
// value k + half, down to one; the same tree however the values are spread over lanes.
inline float tree_sum(V* p) {
  for (int half = kKeyBlock / N / 2; half >= 1; half /= 2) {
    for (int i = 0; i < half; ++i) {
      p[i] = Ops::add(p[i], p[i + half]);
    }
  }
  return Ops::halving_sum(p[0]);
}

// s [M, kKeyBlock] = q' [M, dims] against a transposed block kt [dims, kKeyBlock]: one chain of
// fused multiply-adds over the dims per score, KV vectors of keys at a time.
template <int M>
void scores(const float* qt, const float* kt, int dims, float* s) {
  constexpr int KV = Ops::kScoreVectors;
  for (int k0 = 0; k0 < kKeyBlock; k0 += KV * N) {
    V acc[M][KV];
    for (int m = 0; m < M; ++m) {
      for (int v = 0; v < KV; ++v) {
        acc[m][v] = Ops::set1(0.0f);
      }
    }
    for (int d = 0; d < dims; ++d) {
      V k[KV];
      for (int v = 0; v < KV; ++v) {
        k[v] = Ops::load(kt + d * kKeyBlock + k0 + v * N);
      }
      for (int m = 0; m < M; ++m) {
        const V q = Ops::set1(qt[m * dims + d]);
        for (int v = 0; v < KV; ++v) {
          acc[m][v] = Ops::fma(q, k[v], acc[m][v]);
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      for (int v = 0; v < KV; ++v) {
        Ops::store(s + m * kKeyBlock + k0 + v * N, acc[m][v]);
      }
    }
  }
}

template <int M = Ops::kTile>
void scores_for(int count, const float* qt, const float* kt, int dims, float* s) {
  if constexpr (M > 1) {
    if (count < M) {
      return scores_for<M - 1>(count, qt, kt, dims, s);
    }
  }
  scores<M>(qt, kt, dims, s);
}

// o [MQ, DV vectors from d0] = o * c, then + p_j v_j for the block's first `keys` keys in order;
// each value row is loaded once for the MQ queries.
template <int MQ, int DV>
void accumulate(const float* p, const float* c, float* o, int dims, int d0, const float* v, int64_t stride,
                int keys) {
  V acc[MQ][DV];
  for (int m = 0; m < MQ; ++m) {
    const V cm = Ops::set1(c[m]);
    for (int i = 0; i < DV; ++i) {
      acc[m][i] = Ops::mul(Ops::load(o + m * dims + d0 + i * N), cm);
    }
  }
  for (int j = 0; j < keys; ++j) {
    V x[DV];
    for (int i = 0; i < DV; ++i) {
      x[i] = Ops::load(v + j * stride + d0 + i * N);
    }
    for (int m = 0; m < MQ; ++m) {
      const V pj = Ops::set1(p[m * kKeyBlock + j]);
      for (int i = 0; i < DV; ++i) {
        acc[m][i] = Ops::fma(pj, x[i], acc[m][i]);
      }
    }
  }
  for (int m = 0; m < MQ; ++m) {
    for (int i = 0; i < DV; ++i) {
      Ops::store(o + m * dims + d0 + i * N, acc[m][i]);
    }
  }
}

template <int MQ, int DV = Ops::kValueVectors>
void accumulate_dims(const float* p, const float* c, float* o, int dims, int d0, const float* v, int64_t stride,
                     int keys) {
  if constexpr (DV > 1) {
    if ((dims - d0) / N < DV) {
      return accumulate_dims<MQ, DV - 1>(p, c, o, dims, d0, v, stride, keys);
    }
  }
  accumulate<MQ, DV>(p, c, o, dims, d0, v, stride, keys);
}

template <int MQ = Ops::kValueQueries>
void accumulate_queries(int count, const float* p, const float* c, float* o, int dims, int d0, const float* v,
                        int64_t stride, int keys) {
  if constexpr (MQ > 1) {
    if (count < MQ) {
      return accumulate_queries<MQ - 1>(count, p, c, o, dims, d0, v, stride, keys);
    }
  }
  accumulate_dims<MQ>(p, c, o, dims, d0, v, stride, keys);
}

// The block's softmax step for each of the tile's `count` queries: scores outside [lo, hi) masked,
// the new maximum, the carry c of the old sums (N queries' at once), p in place of the scores, and l.
void softmax(int count, int j0, const int* lo, const int* hi, TileState& t) {
  constexpr int NV = kKeyBlock / N;
  for (int m = 0; m < count; ++m) {
    float* row = t.s + m * kKeyBlock;
    V s[NV];
    for (int v = 0; v < NV; ++v) {
      s[v] = Ops::load(row + v * N);
    }
    if (j0 < lo[m] || j0 + kKeyBlock > hi[m]) {
      for (int v = 0; v < NV; ++v) {
        s[v] = Ops::keep_lanes(s[v], lo[m] - j0 - v * N, hi[m] - j0 - v * N);
        Ops::store(row + v * N, s[v]);
      }
    }
    V most = s[0];
    for (int v = 1; v < NV; ++v) {
      most = Ops::max(most, s[v]);
    }
    t.top[m] = larger(t.m[m], Ops::lane_max(most));
  }
  for (int m = 0; m < count; m += N) {
    Ops::store(t.c + m, exp_nonpositive(Ops::sub(Ops::load(t.m + m), Ops::load(t.top + m))));
  }
  for (int m = 0; m < count; ++m) {
    float* row = t.s + m * kKeyBlock;
    const V shift = Ops::set1(t.top[m]);
    V p[NV];
    for (int v = 0; v < NV; ++v) {
      p[v] = exp_nonpositive(Ops::sub(Ops::load(row + v * N), shift));
      Ops::store(row + v * N, p[v]);
    }
    t.l[m] = std::fma(t.l[m], t.c[m], tree_sum(p));
    t.m[m] = t.top[m];
  }
}

// The state of queries [first, first + count) of `g` over segment `segment`'s keys, written to
// `states` (query i at i * (dims + 2): o, then m and l); queries without a key there get the empty
// state (m = -inf, l = 0, o = 0), which merging leaves unchanged.
void segment(const Group& g, int segment_index, int first, int count, Scratch& scratch, float* states) {
  const int dims = g.dims, stride = dims + 2;
  for (int i = 0; i < count; ++i) {
    empty_state(states + i * stride, dims);
  }
  const int s0 = segment_index * kSegment, s1 = std::min(s0 + kSegment, g.length);
  const int a = std::max(s0, g.lo(first) / kKeyBlock * kKeyBlock), b = std::min(s1, g.hi(first + count - 1));
  if (a >= b) {
    return;
  }
  float* kt = scratch.keys(dims);
  Ops::transpose(g.k + a * g.k_stride, g.k_stride, b - a, dims, kt);
  TileState t = scratch.tile(dims);
  for (int t0 = 0; t0 < count; t0 += Ops::kTile) {
    const int n = std::min(Ops::kTile, count - t0);
    int lo[Ops::kTile], hi[Ops::kTile];
    for (int m = 0; m < n; ++m) {
      lo[m] = g.lo(first + t0 + m);
      hi[m] = g.hi(first + t0 + m);
      const float* q = g.query(first + t0 + m);
      for (int d = 0; d < dims; ++d) {
        t.q[m * dims + d] = q[d] * g.scale;
      }
      std::fill_n(t.o + m * dims, dims, 0.0f);
      t.m[m] = -INFINITY;
      t.l[m] = 0.0f;
    }
    const int ta = std::max(a, lo[0] / kKeyBlock * kKeyBlock), tb = std::min(b, hi[n - 1]);
    for (int j0 = ta; j0 < tb; j0 += kKeyBlock) {
      scores_for(n, t.q, kt + (j0 - a) * dims, dims, t.s);
      softmax(n, j0, lo, hi, t);
      const int keys = std::min(kKeyBlock, tb - j0);
      const float* v = g.v + j0 * g.v_stride;
      for (int m0 = 0; m0 < n; m0 += Ops::kValueQueries) {
        for (int d0 = 0; d0 < dims; d0 += Ops::kValueVectors * N) {
          accumulate_queries(n - m0, t.s + m0 * kKeyBlock, t.c + m0, t.o + m0 * dims, dims, d0, v, g.v_stride,
                             keys);
        }
      }
    }
    for (int m = 0; m < n; ++m) {
      float* state = states + (t0 + m) * stride;
      std::copy_n(t.o + m * dims, dims, state);
      state[dims] = t.m[m];
      state[dims + 1] = t.l[m];
    }
  }
}

// total = total merged with one segment's state, for `count` queries (states as `segment` writes).
void merge(const float* part, float* total, int count, int dims) {
  const int stride = dims + 2;
  for (int i = 0; i < count; ++i) {
    const float* s = part + i * stride;
    float* t = total + i * stride;
    const float top = larger(t[dims], s[dims]);
    const float a = exp_scalar(t[dims] - top), b = exp_scalar(s[dims] - top);
    const V av = Ops::set1(a), bv = Ops::set1(b);
    for (int d = 0; d < dims; d += N) {
      Ops::store(t + d, Ops::fma(Ops::load(s + d), bv, Ops::mul(Ops::load(t + d), av)));
    }
    t[dims] = top;
    t[dims + 1] = std::fma(s[dims + 1], b, t[dims + 1] * a);
  }
}

// out = o / l for each of the `count` queries from `first`.
void finish(const Group& g, const float* total, int first, int count) {
  const int stride = g.dims + 2;
  for (int i = 0; i < count; ++i) {
    const float* t = total + i * stride;
    float* out = g.output(first + i);
    const V l = Ops::set1(t[g.dims + 1]);
    for (int d = 0; d < g.dims; d += N) {
      Ops::store(out + d, Ops::div(Ops::load(t + d), l));
    }
  }
}
