// The register tile of radixserve's float32 linear over weights packed in blocks of 16 columns
// ([N/16][K][16]): cpu_kernels.cpp's op-by-op linear and decode_layers.cpp's one-call decode
// step both run it.
#pragma once

#include <cstdint>

#include "vec.h"

namespace radixserve {

constexpr int kCols = 16;  // columns per packed block

// A decode step's few rows (up to 8) stream the weights from memory at 16 multiply-adds per
// cache line: with Prefetch each line is asked for 128 lines ahead, into L2 (locality 1); the
// many-row path's 6-row tiles ask too (the first tile of a pass streams the block, the others
// find it in cache), its last few rows do not. The hardware prefetcher alone
// left one thread at 6.5 GB/s on a Zen 2-era EPYC, 8.6 GB/s with a prefetch into L1 64 lines
// ahead; on a Zen 4 EPYC, one thread over SmolLM2's 538 MB at 8 rows, into L1 64 ahead
// 16.4-17.0 GB/s, into L2 128 ahead 24.4-24.5 (`benchmarks/engine_kernels.py --rows 8
// --num-threads 1`).
constexpr int kPrefetchAhead = 128 * kCols;  // floats

// R rows x ncols (<= 16) columns of y from R rows of x [R][K] and one packed block w [K][16]:
// y = (Acc ? y : 0) + x . w (+ bias, where given)
template <int R, bool Prefetch, bool Acc = false>
void linear_tile(const float* __restrict x, const float* __restrict w, int K,
                 float* __restrict y, int64_t ldy, int ncols, const float* bias) {
  v8f a0[R], a1[R];
  for (int m = 0; m < R; ++m) a0[m] = a1[m] = v8f{};
  for (int k = 0; k < K; ++k) {
    if constexpr (Prefetch) __builtin_prefetch(w + k * kCols + kPrefetchAhead, 0, 1);
    const v8f w0 = load8(w + k * kCols), w1 = load8(w + k * kCols + 8);
    for (int m = 0; m < R; ++m) {
      const float s = x[(int64_t)m * K + k];
      a0[m] += w0 * s;
      a1[m] += w1 * s;
    }
  }
  for (int m = 0; m < R; ++m) {
    float* ym = y + m * ldy;
    if (!Acc && bias == nullptr && ncols == kCols) {
      store8(ym, a0[m]);
      store8(ym + 8, a1[m]);
    } else {  // adding into y, a bias, or the last block of a width not a multiple of 16
      float t[kCols];
      store8(t, a0[m]);
      store8(t + 8, a1[m]);
      for (int j = 0; j < ncols; ++j) ym[j] = (Acc ? ym[j] : 0.f) + t[j] + (bias ? bias[j] : 0.f);
    }
  }
}

// act [rows][16] (row stride lda) = silu(g) * u over one column block's gate and up tiles, each
// [rows][16] contiguous: the epilogue of a gate/up linear with the activation inside it (the
// decode step's and the prefill's), so the [rows, 2I] gate/up product is never written out
inline void silu_mul_block(const float* g, const float* u, int rows, float* act,
                           int64_t lda) {
  for (int i = 0; i < rows; ++i)
    for (int c = 0; c < kCols; c += 8) {
      const v8f gi = load8(g + i * kCols + c);
      store8(act + i * lda + c, gi / (1.f + exp8(-gi)) * load8(u + i * kCols + c));
    }
}

typedef void (*tile_fn)(const float*, const float*, int, float*, int64_t, int, const float*);

// linear_tile for 1..8 rows, by row count
template <bool Prefetch, bool Acc = false>
constexpr tile_fn kTilesOf[9] = {
    nullptr,
    linear_tile<1, Prefetch, Acc>, linear_tile<2, Prefetch, Acc>, linear_tile<3, Prefetch, Acc>,
    linear_tile<4, Prefetch, Acc>, linear_tile<5, Prefetch, Acc>, linear_tile<6, Prefetch, Acc>,
    linear_tile<7, Prefetch, Acc>, linear_tile<8, Prefetch, Acc>};

}  // namespace radixserve
