// radixserve's CPU kernels, float32: a linear layer over weights packed once for it, and decode
// attention over the slot-indexed KV pool.
//
// Linear (y = x W^T): the weight [N, K] is packed once into column blocks of 16, [N/16][K][16],
// so a block streams through memory once and contiguously; each thread takes whole column blocks
// and multiplies up to 8 rows of x at a time against it, the 8 x 16 results held in registers
// (a decode step's few rows: one pass over the weights, which is what bounds it). More rows go
// 6 at a time, 96 rows per pass so their x stays in cache while the blocks stream by.
//
// Decode attention: decode_attention.h (one call per layer here; decode_layers.cpp runs a
// whole decode step in one call).
//
// Built at first use by radixserve.model.kernels with the machine's C++ compiler
// (-O3 -march=native -fopenmp); called through ctypes with raw pointers.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>

#include <vector>
#ifdef __linux__
#include <sys/mman.h>
#endif

#include "decode_attention.h"
#include "linear_tile.h"
#include "rms_norm.h"
#include "vec.h"

namespace {

using radixserve::exp8;  // the vector type and exp shared with decode_attention.h (vec.h)
using radixserve::exp_approx;
using radixserve::kCols;  // the linear's tile and its packed blocks (linear_tile.h)
using radixserve::kTilesOf;
using radixserve::silu_mul_block;
using radixserve::linear_tile;
using radixserve::load8;
using radixserve::store8;
using radixserve::v8f;
using radixserve::decode::attend_rows;
using radixserve::decode::rope_row;
using radixserve::decode::Split;

// ---- linear ------------------------------------------------------------------------------------
constexpr int kRowsPerPass = 96;

// y [rows][ncols] (row stride ldy) (+)= x [rows][K] times one packed column block w [K][16]
template <bool Acc = false>
inline void block_rows(const float* xb, int rows, int K, const float* w, float* yb, int64_t ldy,
                       int ncols) {
  if (rows <= 8) {  // a decode step: every weight read once
    kTilesOf<true, Acc>[rows](xb, w, K, yb, ldy, ncols, nullptr);
    return;
  }
  // each 6-row tile asks for the block's lines 128 ahead into L2 (linear_tile.h): the first
  // tile of a pass streams the block from L3 or memory, the rest find it in cache and lose
  // little to the hints. A prefill of SmolLM2 on a Zen 4 EPYC, two threads: 1.02x alternated
  // in one process with the tree before (rounds 0.96-1.09x), 1.06-1.09x in separate ones
  int m = 0;
  for (; m + 6 <= rows; m += 6)
    linear_tile<6, true, Acc>(xb + (int64_t)m * K, w, K, yb + m * ldy, ldy, ncols, nullptr);
  if (m < rows)
    kTilesOf<false, Acc>[rows - m](xb + (int64_t)m * K, w, K, yb + m * ldy, ldy, ncols, nullptr);
}

// y [M, N] (+)= x [M, K] (contiguous) times the packed weight's transpose: one parallel region
// for every pass; a static schedule gives each thread the same blocks in every pass, so no
// thread waits for another between passes (a wait that costs a whole time slice when the
// partner thread is descheduled on a shared machine)
template <bool Acc>
void linear(const float* x, int M, int K, const float* packed, int N, float* y, int threads) {
  const int blocks = (N + kCols - 1) / kCols;
  if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
  for (int m0 = 0; m0 < M; m0 += kRowsPerPass) {
    const int rows = M - m0 < kRowsPerPass ? M - m0 : kRowsPerPass;
    const float* xb = x + (int64_t)m0 * K;
#pragma omp for schedule(static) nowait
    for (int b = 0; b < blocks; ++b) {
      const int ncols = N - b * kCols < kCols ? N - b * kCols : kCols;
      block_rows<Acc>(xb, rows, K, packed + (int64_t)b * K * kCols,
                      y + (int64_t)m0 * N + b * kCols, N, ncols);
    }
  }
}

// Rows split into chunks of keys computed as independent items, then each row's chunks merged
// (decode_attention.h); one parallel region.
template <int NC>
void run(const float* q, const float* k, const float* v, const int64_t* slots,
         const int64_t* offsets, int rows, int heads, int kv_heads, int d, float scale,
         float* out, float* lse, int threads) {
  const Split split(offsets, rows, heads, d, threads);
  std::vector<float> part((size_t)split.items * split.stride);
#pragma omp parallel num_threads(threads)
  attend_rows<NC>(split, q, k, v, slots, offsets, rows, heads, kv_heads, d, scale, part.data(),
                  out, lse);
}

}  // namespace

extern "C" {

// Floats a weight [N, K] takes once packed (N rounded up to whole blocks of 16).
int64_t radixserve_packed_size(int N, int K) { return (int64_t)((N + kCols - 1) / kCols) * kCols * K; }

// w [N, K] -> packed [N/16][K][16], columns past N zero.
void radixserve_pack_weight(const float* w, int N, int K, float* packed) {
  const int blocks = (N + kCols - 1) / kCols;
  for (int b = 0; b < blocks; ++b)
    for (int k = 0; k < K; ++k)
      for (int j = 0; j < kCols; ++j) {
        const int n = b * kCols + j;
        packed[((int64_t)b * K + k) * kCols + j] = n < N ? w[(int64_t)n * K + k] : 0.f;
      }
}

// y [M, N] = x [M, K] (contiguous) times the packed weight's transpose.
void radixserve_linear_f32(const float* x, int M, int K, const float* packed, int N, float* y,
                           int threads) {
  linear<false>(x, M, K, packed, N, y, threads);
}

// y [M, N] += x [M, K] W^T: a residual added in the linear's epilogue (no output tensor, no
// separate add over it).
void radixserve_linear_add_f32(const float* x, int M, int K, const float* packed, int N,
                               float* y, int threads) {
  linear<true>(x, M, K, packed, N, y, threads);
}

// act [M, I] = silu(x Wg^T) * (x Wu^T), x [M, K] (contiguous), the gate and up weights packed
// as one [2I/16][K][16] (gate's blocks first; I a multiple of 16). A thread computes gate block
// j and up block I/16 + j for a pass's rows into two small buffers (in L1) and writes their
// product: the [M, 2I] gate/up output is never written to memory nor read back.
void radixserve_linear_silu_f32(const float* x, int M, int K, const float* packed, int I,
                                float* act, int threads) {
  const int blocks = I / kCols;
  if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
  {
    float g[kRowsPerPass * kCols], u[kRowsPerPass * kCols];
    for (int m0 = 0; m0 < M; m0 += kRowsPerPass) {
      const int rows = M - m0 < kRowsPerPass ? M - m0 : kRowsPerPass;
      const float* xb = x + (int64_t)m0 * K;
#pragma omp for schedule(static) nowait
      for (int j = 0; j < blocks; ++j) {
        block_rows(xb, rows, K, packed + (int64_t)j * K * kCols, g, kCols, kCols);
        block_rows(xb, rows, K, packed + (int64_t)(blocks + j) * K * kCols, u, kCols, kCols);
        silu_mul_block(g, u, rows, act + (int64_t)m0 * I + j * kCols, I);
      }
    }
  }
}

// q, out: [rows, heads, d]; k, v: one layer of the pool, [slots, kv_heads, d]; row r attends
// the pool slots slots[offsets[r] .. offsets[r + 1]); lse ([rows, heads]) may be null.
// Returns 0, or -1 when the shapes are not supported.
int radixserve_decode_attention_f32(const float* q, const float* k, const float* v,
                                    const int64_t* slots, const int64_t* offsets, int rows,
                                    int heads, int kv_heads, int d, float scale, float* out,
                                    float* lse, int threads) {
  if (kv_heads <= 0 || heads % kv_heads != 0 || d <= 0 || d % 8 != 0) return -1;
  if (threads < 1) threads = 1;
  if (d == 64)
    run<8>(q, k, v, slots, offsets, rows, heads, kv_heads, d, scale, out, lse, threads);
  else if (d == 128)
    run<16>(q, k, v, slots, offsets, rows, heads, kv_heads, d, scale, out, lse, threads);
  else
    run<0>(q, k, v, slots, offsets, rows, heads, kv_heads, d, scale, out, lse, threads);
  return 0;
}
}

// ---- the small per-layer ops, fused (as vLLM-CPU's rms_norm / fused_add_rms_norm /
// silu_and_mul / rotary_embedding + reshape_and_cache ops do) ---------------------------------
namespace {

// small ops split over threads only when there is enough work to pay for waking them
constexpr int64_t kParallelMin = 1 << 16;

}  // namespace

extern "C" {

// Optionally x += delta (in place), then y = x / sqrt(mean(x^2) + eps) * w, per row of [T, H].
void radixserve_add_rms_norm_f32(float* x, const float* delta, const float* w, int T, int H,
                                 float eps, float* y, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if ((int64_t)T * H >= kParallelMin)
  for (int t = 0; t < T; ++t)
    radixserve::add_rms_norm_row(x + (int64_t)t * H, delta ? delta + (int64_t)t * H : nullptr, w,
                                 H, eps, y + (int64_t)t * H);
}

// out [T, I] = silu(gu[:, :I]) * gu[:, I:], gu [T, 2I]
void radixserve_silu_mul_f32(const float* gu, int T, int I, float* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if ((int64_t)T * I >= kParallelMin)
  for (int t = 0; t < T; ++t) {
    const float* g = gu + (int64_t)t * 2 * I;
    const float* u = g + I;
    float* o = out + (int64_t)t * I;
    int i = 0;
    for (; i + 8 <= I; i += 8) {
      const v8f gi = load8(g + i);
      store8(o + i, gi / (1.f + exp8(-gi)) * load8(u + i));
    }
    for (; i < I; ++i) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
  }
}

// Rotate the query and key heads of qkv [T, row] (row >= (heads + 2 kv_heads) * d; q heads,
// then k heads, then v heads) in place by cos / signed sin [T, d] (half-split layout:
// x * cos + (x2, x1) * ssin), then store each token's k and v heads at its pool slot:
// k_pool / v_pool [slots, kv_heads, d].
void radixserve_rope_and_cache_f32(float* qkv, int64_t row, int T, int heads, int kv_heads, int d,
                                   const float* cos, const float* ssin, const int64_t* slots,
                                   float* k_pool, float* v_pool, int threads) {
  const int64_t kv_width = (int64_t)kv_heads * d;
#pragma omp parallel for schedule(static) num_threads(threads) if ((int64_t)T * row >= kParallelMin)
  for (int t = 0; t < T; ++t) {
    float* r = qkv + (int64_t)t * row;
    const float* c = cos + (int64_t)t * d;
    const float* s = ssin + (int64_t)t * d;
    rope_row(r, heads, kv_heads, d, c, s);
    const int64_t slot = slots[t];
    std::memcpy(k_pool + slot * kv_width, r + (int64_t)heads * d, sizeof(float) * kv_width);
    std::memcpy(v_pool + slot * kv_width, r + (int64_t)(heads + kv_heads) * d,
                sizeof(float) * kv_width);
  }
}
}

// ---- memory ----------------------------------------------------------------------------------
extern "C" {

// Ask the kernel to back [p, p + bytes) with transparent huge pages (2 MB), before it is first
// written: a decode step streams every packed weight once, and with 4 KB pages each page costs
// a TLB miss (the 538 MB of SmolLM2's weights at 8 rows: 1.11x faster here on huge pages).
// 0, or -1 where the system has no such advice (the buffer then stays on small pages).
int radixserve_advise_huge_pages(void* p, int64_t bytes) {
#ifdef MADV_HUGEPAGE
  return madvise(p, (size_t)bytes, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
  return -1;
#endif
}
}
