// radixserve's CPU kernels, float32: a linear layer over weights packed once for it, and decode
// attention over the slot-indexed KV pool.
//
// Linear (y = x W^T): the weight [N, K] is packed once into column blocks of 16, [N/16][K][16],
// so a block streams through memory once and contiguously; each thread takes whole column blocks
// and multiplies up to 8 rows of x at a time against it, the 8 x 16 results held in registers
// (a decode step's few rows: one pass over the weights, which is what bounds it). More rows go
// 6 at a time, 96 rows per pass so their x stays in cache while the blocks stream by.
//
// Decode attention: one query token per row, each row's context given as a list of pool slots. Work items are (row, KV head) pairs shared out
// over the OpenMP threads (the same runtime PyTorch uses, so no second thread pool); each item
// streams its keys in blocks with an online softmax (running max and sum), so no score matrix
// and no gathered copy of K/V is ever made. Float32 only; the query heads of one KV head are
// processed together, so every K/V row read serves all of them.
//
// Built at first use by radixserve.model.kernels with the machine's C++ compiler
// (-O3 -march=native -fopenmp); called through ctypes with raw pointers.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>

namespace {

// ---- linear ------------------------------------------------------------------------------------
typedef float v8f __attribute__((vector_size(32)));  // 8 floats: one AVX register (two on SSE)
constexpr int kCols = 16;                              // columns per packed block
constexpr int kRowsPerPass = 96;

inline v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, v8f v) { __builtin_memcpy(p, &v, sizeof(v)); }

// rows x 16 columns of y from `rows` rows of x and one packed block w [K][16]
template <int R>
void linear_tile(const float* __restrict x, const float* __restrict w, int K,
                 float* __restrict y, int64_t ldy, int ncols) {
  v8f a0[R], a1[R];
  for (int m = 0; m < R; ++m) a0[m] = a1[m] = v8f{};
  for (int k = 0; k < K; ++k) {
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
const tile_fn kTiles[9] = {nullptr,         linear_tile<1>, linear_tile<2>,
                           linear_tile<3>,  linear_tile<4>, linear_tile<5>,
                           linear_tile<6>,  linear_tile<7>, linear_tile<8>};

constexpr int kBlock = 32;     // keys scored per pass
constexpr int kMaxGroup = 16;  // query heads per KV head

// exp(x) by the Cody-Waite reduction and a degree-6 polynomial: plain arithmetic, so the loops
// that call it vectorize. Relative error about 2e-7; x is clamped to [-87, 88] (exp(-87) is
// 1.6e-38: a softmax weight that small is zero to float32 sums).
#pragma omp declare simd
inline float exp_approx(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <int D>
inline float dot(const float* __restrict a, const float* __restrict b, int d) {
  float s = 0.f;
  const int n = D > 0 ? D : d;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <int D>
void one_item(const float* __restrict q, const float* __restrict k, const float* __restrict v,
              const int64_t* __restrict slots, int64_t len, int group, int d, int64_t row_stride,
              float scale, float* __restrict out, float* __restrict lse) {
  const int n = D > 0 ? D : d;
  float m[kMaxGroup], l[kMaxGroup];
  float s[kMaxGroup][kBlock];
  // the running output lives in `out` itself
  for (int g = 0; g < group; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
    for (int i = 0; i < n; ++i) out[g * n + i] = 0.f;
  }
  for (int64_t j0 = 0; j0 < len; j0 += kBlock) {
    const int nb = (int)((len - j0) < kBlock ? (len - j0) : kBlock);
    for (int j = 0; j < nb; ++j) {
      const float* kr = k + slots[j0 + j] * row_stride;
      for (int g = 0; g < group; ++g) s[g][j] = dot<D>(q + g * n, kr, n) * scale;
    }
    for (int g = 0; g < group; ++g) {
      float mb = m[g];
      for (int j = 0; j < nb; ++j) mb = s[g][j] > mb ? s[g][j] : mb;
      const float corr = m[g] == -INFINITY ? 0.f : exp_approx(m[g] - mb);
      float sum = 0.f;
      float* sg = s[g];
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < nb; ++j) {
        sg[j] = exp_approx(sg[j] - mb);
        sum += sg[j];
      }
      l[g] = l[g] * corr + sum;
      m[g] = mb;
      if (corr != 1.f) {
        float* o = out + g * n;
#pragma omp simd
        for (int i = 0; i < n; ++i) o[i] *= corr;
      }
    }
    for (int j = 0; j < nb; ++j) {
      const float* vr = v + slots[j0 + j] * row_stride;
      for (int g = 0; g < group; ++g) {
        const float p = s[g][j];
        float* o = out + g * n;
#pragma omp simd
        for (int i = 0; i < n; ++i) o[i] += p * vr[i];
      }
    }
  }
  for (int g = 0; g < group; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    float* o = out + g * n;
    for (int i = 0; i < n; ++i) o[i] *= inv;
    if (lse != nullptr) lse[g] = m[g] + std::log(l[g]);
  }
}

template <int D>
void run(const float* q, const float* k, const float* v, const int64_t* slots,
         const int64_t* offsets, int rows, int heads, int kv_heads, int d, float scale,
         float* out, float* lse, int threads) {
  const int group = heads / kv_heads;
  const int64_t row_stride = (int64_t)kv_heads * d;
  const int items = rows * kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int it = 0; it < items; ++it) {
    const int r = it / kv_heads, h = it % kv_heads;
    const int64_t first = offsets[r], len = offsets[r + 1] - first;
    const int64_t at = ((int64_t)r * heads + (int64_t)h * group) * d;
    one_item<D>(q + at, k + (int64_t)h * d, v + (int64_t)h * d, slots + first, len, group, d,
                row_stride, scale, out + at, lse ? lse + (int64_t)r * heads + h * group : nullptr);
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
        kTiles[rows](xb, w, K, yb, N, ncols);
        continue;
      }
      int m = 0;
      for (; m + 6 <= rows; m += 6) linear_tile<6>(xb + (int64_t)m * K, w, K, yb + (int64_t)m * N, N, ncols);
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
  if (kv_heads <= 0 || heads % kv_heads != 0 || heads / kv_heads > kMaxGroup || d <= 0)
    return -1;
  if (threads < 1) threads = 1;
  if (d == 64)
    run<64>(q, k, v, slots, offsets, rows, heads, kv_heads, d, scale, out, lse, threads);
  else if (d == 128)
    run<128>(q, k, v, slots, offsets, rows, heads, kv_heads, d, scale, out, lse, threads);
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
#pragma omp simd
    for (int i = 0; i < I; ++i) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
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
