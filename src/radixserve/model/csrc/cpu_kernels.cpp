// radixserve's CPU kernels, float32: a linear layer over weights packed once for it, and decode
// attention over the slot-indexed KV pool.
//
// Linear (y = x W^T): the weight [N, K] is packed once into column blocks of 16, [N/16][K][16],
// so a block streams through memory once and contiguously; each thread takes whole column blocks
// and multiplies up to 8 rows of x at a time against it, the 8 x 16 results held in registers
// (a decode step's few rows: one pass over the weights, which is what bounds it). More rows go
// 6 at a time, 96 rows per pass so their x stays in cache while the blocks stream by.
//
// Decode attention: one query token per row, each row's context given as a list of pool slots.
// A row's keys are split into chunks (flash-decoding's split: about 4 work items per thread,
// whatever the rows' lengths) shared out over the OpenMP threads (the same runtime PyTorch
// uses, so no second thread pool), then each row's chunks are merged by their log-sum-exps.
// An item takes every head of its row, so each slot's K and V rows (all KV heads) are read
// whole and in order, wherever the slots lie in the pool; it scores 8 keys at a time with the
// 8 dot products finished together, keeps a running max and sum (online softmax, no score
// matrix, no gathered copy of K/V) and accumulates the output in registers. Float32 only.
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
#ifdef __AVX__
#include <immintrin.h>
#endif

#include "vec.h"

namespace {

using radixserve::exp8;  // the vector type and exp shared with prefill_attention.cpp (vec.h)
using radixserve::exp_approx;
using radixserve::load8;
using radixserve::store8;
using radixserve::v8f;

// ---- linear ------------------------------------------------------------------------------------
constexpr int kCols = 16;  // columns per packed block
constexpr int kRowsPerPass = 96;

// A decode step's few rows (up to 8) stream the weights from memory at 16 multiply-adds per
// cache line: with Prefetch each line is asked for 64 lines ahead (the hardware prefetcher alone
// left one thread at 6.5 GB/s on this EPYC, 8.6 GB/s with it); the many-row path reuses each
// block from cache and goes without.
constexpr int kPrefetchAhead = 64 * kCols;  // floats

// rows x 16 columns of y from `rows` rows of x and one packed block w [K][16]
template <int R, bool Prefetch>
void linear_tile(const float* __restrict x, const float* __restrict w, int K,
                 float* __restrict y, int64_t ldy, int ncols) {
  v8f a0[R], a1[R];
  for (int m = 0; m < R; ++m) a0[m] = a1[m] = v8f{};
  for (int k = 0; k < K; ++k) {
    if constexpr (Prefetch) __builtin_prefetch(w + k * kCols + kPrefetchAhead);
    const v8f w0 = load8(w + k * kCols), w1 = load8(w + k * kCols + 8);
    for (int m = 0; m < R; ++m) {
      const float s = x[(int64_t)m * K + k];
      a0[m] += w0 * s;
      a1[m] += w1 * s;
    }
  }
  for (int m = 0; m < R; ++m) {
    if (ncols == kCols) {
      store8(y + m * ldy, a0[m]);
      store8(y + m * ldy + 8, a1[m]);
    } else {  // the last block of a width that is not a multiple of 16
      float t[kCols];
      store8(t, a0[m]);
      store8(t + 8, a1[m]);
      std::memcpy(y + m * ldy, t, sizeof(float) * ncols);
    }
  }
}

typedef void (*tile_fn)(const float*, const float*, int, float*, int64_t, int);
template <bool P>
constexpr tile_fn kTilesOf[9] = {nullptr,            linear_tile<1, P>, linear_tile<2, P>,
                                  linear_tile<3, P>, linear_tile<4, P>, linear_tile<5, P>,
                                  linear_tile<6, P>, linear_tile<7, P>, linear_tile<8, P>};
constexpr const tile_fn* kTiles = kTilesOf<false>;
constexpr const tile_fn* kStreamTiles = kTilesOf<true>;

constexpr int kKeys = 32;        // keys scored per pass (a multiple of 8)
constexpr int64_t kMinChunk = 64;  // fewest keys a work item takes

// lane j of the result = the sum of the lanes of a[j]: eight dot products finished at once
inline v8f sum_lanes8(const v8f* a) {
#ifdef __AVX__
  const __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]);
  const __m256 t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
  const __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]);
  const __m256 t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return (v8f)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                            _mm256_permute2f128_ps(u0, u1, 0x31));
#else
  v8f r;
  for (int j = 0; j < 8; ++j) {
    float s = 0.f;
    for (int i = 0; i < 8; ++i) s += a[j][i];
    r[j] = s;
  }
  return r;
#endif
}

// scores s[0..nb) of one query head q [d] against the keys at rows kr[j] (d = 8 * nc)
template <int NC>
inline void scores(const float* __restrict q, const float* const* kr, int nb, int nc,
                   float scale, float* __restrict s) {
  const int n = NC > 0 ? NC : nc;
  for (int j0 = 0; j0 < nb; j0 += 8) {
    const float* r[8];
    for (int j = 0; j < 8; ++j) r[j] = kr[j0 + j < nb ? j0 + j : nb - 1];  // tail: repeats
    v8f acc[8] = {};
    for (int c = 0; c < n; ++c) {
      const v8f qc = load8(q + 8 * c);
      for (int j = 0; j < 8; ++j) acc[j] += qc * load8(r[j] + 8 * c);
    }
    store8(s + j0, sum_lanes8(acc) * scale);  // s has room for a whole group of 8
  }
}

// o [d] = o * corr + sum_j p[j] v at rows vr[j], 64 floats of o held in registers at a time
template <int NC>
inline void weighted_sum(const float* p, const float* const* vr, int nb, int nc, float corr,
                         float* __restrict o) {
  const int n = NC > 0 ? NC : nc;
  for (int c0 = 0; c0 < n; c0 += 8) {
    const int w = n - c0 < 8 ? n - c0 : 8;
    v8f acc[8];
    for (int c = 0; c < w; ++c) acc[c] = load8(o + 8 * (c0 + c)) * corr;
    for (int j = 0; j < nb; ++j) {
      const float pj = p[j];
      const float* r = vr[j] + 8 * c0;
      for (int c = 0; c < w; ++c) acc[c] += pj * load8(r + 8 * c);
    }
    for (int c = 0; c < w; ++c) store8(o + 8 * (c0 + c), acc[c]);
  }
}

// s[0..nb) -> exp(s - mb), mb = the larger of m and their maximum (returned); s has room for
// whole groups of 8, whose unused lanes are set to -inf first.
inline float softmax_block(float* s, int nb, float m) {
  for (int j = nb; j % 8; ++j) s[j] = -INFINITY;
  v8f mv = v8f{} + m;
  for (int j = 0; j < nb; j += 8) {
    const v8f x = load8(s + j);
    mv = x > mv ? x : mv;
  }
  float mb = m;
  for (int i = 0; i < 8; ++i) mb = mv[i] > mb ? mv[i] : mb;
  for (int j = 0; j < nb; j += 8) store8(s + j, exp8(load8(s + j) - mb));
  return mb;
}

// One work item: every query head of one row against `n` keys of its context (pool slots
// `slots`), all KV heads, so the slots' K/V rows are read whole and in order. Leaves the
// unnormalised output o [heads][d] and each head's running max m and sum l.
template <int NC>
void attend_chunk(const float* __restrict q, const float* k, const float* v,
                  const int64_t* slots, int64_t n, int heads, int kv_heads, int d, float scale,
                  float* __restrict o, float* __restrict m, float* __restrict l) {
  const int group = heads / kv_heads;
  const int64_t row = (int64_t)kv_heads * d;
  for (int i = 0; i < heads * d; ++i) o[i] = 0.f;
  for (int hq = 0; hq < heads; ++hq) m[hq] = -INFINITY, l[hq] = 0.f;
  const float* kr[kKeys];
  const float* vr[kKeys];
  float s[kKeys];
  for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
    const int nb = (int)(n - j0 < kKeys ? n - j0 : kKeys);
    for (int h = 0; h < kv_heads; ++h) {
      for (int j = 0; j < nb; ++j) {
        kr[j] = k + slots[j0 + j] * row + (int64_t)h * d;
        vr[j] = v + slots[j0 + j] * row + (int64_t)h * d;
      }
      for (int hq = h * group; hq < (h + 1) * group; ++hq) {
        scores<NC>(q + (int64_t)hq * d, kr, nb, d / 8, scale, s);
        const float mb = softmax_block(s, nb, m[hq]);
        const float corr = m[hq] == -INFINITY ? 0.f : exp_approx(m[hq] - mb);
        float sum = 0.f;
        for (int j = 0; j < nb; ++j) sum += s[j];
        l[hq] = l[hq] * corr + sum;
        m[hq] = mb;
        weighted_sum<NC>(s, vr, nb, d / 8, corr, o + (int64_t)hq * d);
      }
    }
  }
}

// A row's chunks (o, m, l each) merged by their maxima into out [heads][d] and lse [heads].
void merge_chunks(const float* part, int chunks, int heads, int d, float* out, float* lse) {
  const int64_t stride = (int64_t)heads * (d + 2);
  for (int hq = 0; hq < heads; ++hq) {
    float mx = -INFINITY;
    for (int c = 0; c < chunks; ++c) mx = std::fmax(mx, part[c * stride + heads * d + hq]);
    float total = 0.f;
    float* o = out + (int64_t)hq * d;
    for (int i = 0; i < d; ++i) o[i] = 0.f;
    for (int c = 0; c < chunks && mx != -INFINITY; ++c) {
      const float* pc = part + c * stride;
      const float w = std::exp(pc[heads * d + hq] - mx);
      total += w * pc[heads * d + heads + hq];
      for (int i = 0; i < d; ++i) o[i] += w * pc[(int64_t)hq * d + i];
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int i = 0; i < d; ++i) o[i] *= inv;
    if (lse != nullptr) lse[hq] = mx + std::log(total);
  }
}

// Rows split into chunks of `chunk` keys (at least one per row), computed as independent
// items (flash-decoding's split), then each row's chunks merged; one parallel region.
template <int NC>
void run(const float* q, const float* k, const float* v, const int64_t* slots,
         const int64_t* offsets, int rows, int heads, int kv_heads, int d, float scale,
         float* out, float* lse, int threads) {
  const int64_t total = offsets[rows] - offsets[0];
  int64_t chunk = (total + 4 * threads - 1) / (4 * threads);  // about 4 items per thread
  chunk = chunk < kMinChunk ? kMinChunk : (chunk + kKeys - 1) / kKeys * kKeys;
  std::vector<int> first(rows + 1, 0), owner;
  for (int r = 0; r < rows; ++r) {
    const int64_t len = offsets[r + 1] - offsets[r];
    const int n = len > chunk ? (int)((len + chunk - 1) / chunk) : 1;
    first[r + 1] = first[r] + n;
    owner.insert(owner.end(), n, r);
  }
  const int items = first[rows];
  const int64_t stride = (int64_t)heads * (d + 2);
  std::vector<float> part((size_t)items * stride);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < items; ++it) {
      const int r = owner[it];
      const int64_t j0 = (int64_t)(it - first[r]) * chunk;
      const int64_t len = offsets[r + 1] - offsets[r], n = len - j0 < chunk ? len - j0 : chunk;
      float* p = part.data() + it * stride;
      attend_chunk<NC>(q + (int64_t)r * heads * d, k, v, slots + offsets[r] + j0, n, heads,
                       kv_heads, d, scale, p, p + heads * d, p + heads * d + heads);
    }
#pragma omp for schedule(static)
    for (int r = 0; r < rows; ++r)
      merge_chunks(part.data() + first[r] * stride, first[r + 1] - first[r], heads, d,
                   out + (int64_t)r * heads * d, lse ? lse + (int64_t)r * heads : nullptr);
  }
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
  const int blocks = (N + kCols - 1) / kCols;
  if (threads < 1) threads = 1;
  for (int m0 = 0; m0 < M; m0 += kRowsPerPass) {
    const int rows = M - m0 < kRowsPerPass ? M - m0 : kRowsPerPass;
    const float* xb = x + (int64_t)m0 * K;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < blocks; ++b) {
      const float* w = packed + (int64_t)b * K * kCols;
      const int ncols = N - b * kCols < kCols ? N - b * kCols : kCols;
      float* yb = y + (int64_t)m0 * N + b * kCols;
      if (rows <= 8) {  // a decode step: every weight read once
        kStreamTiles[rows](xb, w, K, yb, N, ncols);
        continue;
      }
      int m = 0;
      for (; m + 6 <= rows; m += 6) linear_tile<6, false>(xb + (int64_t)m * K, w, K, yb + (int64_t)m * N, N, ncols);
      if (m < rows) kTiles[rows - m](xb + (int64_t)m * K, w, K, yb + (int64_t)m * N, N, ncols);
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
  for (int t = 0; t < T; ++t) {
    float* xr = x + (int64_t)t * H;
    float* yr = y + (int64_t)t * H;
    float ss = 0.f;
    if (delta != nullptr) {
      const float* dr = delta + (int64_t)t * H;
#pragma omp simd reduction(+ : ss)
      for (int i = 0; i < H; ++i) {
        xr[i] += dr[i];
        ss += xr[i] * xr[i];
      }
    } else {
#pragma omp simd reduction(+ : ss)
      for (int i = 0; i < H; ++i) ss += xr[i] * xr[i];
    }
    const float inv = 1.f / std::sqrt(ss / (float)H + eps);
#pragma omp simd
    for (int i = 0; i < H; ++i) yr[i] = xr[i] * inv * w[i];
  }
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
  const int half = d / 2;
  const int64_t kv_width = (int64_t)kv_heads * d;
#pragma omp parallel for schedule(static) num_threads(threads) if ((int64_t)T * row >= kParallelMin)
  for (int t = 0; t < T; ++t) {
    float* r = qkv + (int64_t)t * row;
    const float* c = cos + (int64_t)t * d;
    const float* s = ssin + (int64_t)t * d;
    for (int h = 0; h < heads + kv_heads; ++h) {
      float* x = r + (int64_t)h * d;
      float tmp[512];
      for (int i = 0; i < d; ++i) tmp[i] = x[i];
#pragma omp simd
      for (int i = 0; i < half; ++i) x[i] = tmp[i] * c[i] + tmp[i + half] * s[i];
#pragma omp simd
      for (int i = half; i < d; ++i) x[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
    }
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
