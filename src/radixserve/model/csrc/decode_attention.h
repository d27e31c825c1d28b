// Decode attention's pieces, shared by the per-layer call (cpu_kernels.cpp) and the whole decode
// step in one call (decode_layers.cpp).
//
// Decode attention: one query token per row, each row's context given as a list of pool slots.
// A row's keys are split into chunks (flash-decoding's split: about 4 work items per thread,
// whatever the rows' lengths) shared out over the OpenMP threads (the same runtime PyTorch
// uses, so no second thread pool), then each row's chunks are merged by their log-sum-exps.
// An item takes every head of its row, so each slot's K and V rows (all KV heads) are read
// whole and in order, wherever the slots lie in the pool; it scores 8 keys at a time with the
// 8 dot products finished together, keeps a running max and sum (online softmax, no score
// matrix, no gathered copy of K/V) and accumulates the output in registers. Float32 only.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>
#ifdef __AVX__
#include <immintrin.h>
#endif

#include "vec.h"

namespace radixserve {
namespace decode {

constexpr int kKeys = 32;        // keys scored per pass (a multiple of 8)
constexpr int64_t kMinChunk = 64;  // fewest keys a work item takes
// keys ahead whose K and V rows are asked for while a block is scored, into L2 (locality 1):
// with the hardware prefetcher alone one thread read a step's pool (B=8 x 512 keys x 30 layers
// of SmolLM2) at about 7 GB/s on a Zen 4 EPYC, a third of a plain read's rate; into L1
// (locality 3) it was slower than no prefetch at all
constexpr int kPrefetchKeys = 64;
// query heads scored together against one load of their shared KV head's rows: 3 needs 24
// accumulators, which AVX-512's 32 vector registers hold (AVX2's 16 do not). With the prefetch:
// that step's attention 27-29 -> 15-16 ms (`benchmarks/engine_attention.py --batches 8
// --contexts 512 --layers 30`, cpu-paged, two threads)
#ifdef __AVX512F__
constexpr int kGroup = 3;
#else
constexpr int kGroup = 1;
#endif

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

// scores s[g][0..nb) (rows kKeys apart) of G query heads q + g * d [d] against the keys at rows
// kr[j] (d = 8 * nc): each key chunk is loaded once for the G heads that share its KV head
template <int NC, int G>
inline void scores(const float* __restrict q, int d, const float* const* kr, int nb, int nc,
                   float scale, float* __restrict s, const float* const* kpf, int npf) {
  const int n = NC > 0 ? NC : nc;
  for (int j0 = 0; j0 < nb; j0 += 8) {
    for (int j = j0; j < j0 + 8 && j < npf; ++j)
      for (int c = 0; c < n; c += 2) __builtin_prefetch(kpf[j] + 8 * c, 0, 1);
    const float* r[8];
    for (int j = 0; j < 8; ++j) r[j] = kr[j0 + j < nb ? j0 + j : nb - 1];  // tail: repeats
    v8f acc[G][8] = {};
    for (int c = 0; c < n; ++c) {
      v8f qc[G];
      for (int g = 0; g < G; ++g) qc[g] = load8(q + g * d + 8 * c);
      for (int j = 0; j < 8; ++j) {
        const v8f kc = load8(r[j] + 8 * c);
        for (int g = 0; g < G; ++g) acc[g][j] += qc[g] * kc;
      }
    }
    for (int g = 0; g < G; ++g)  // s has room for a whole group of 8
      store8(s + g * kKeys + j0, sum_lanes8(acc[g]) * scale);
  }
}

// o_g [d] = o_g * corr[g] + sum_j p[g][j] v at rows vr[j] for the G heads (o_g = o + g * d,
// p's rows kKeys apart): each value chunk is loaded once for the G heads, 8 * G floats of the
// outputs held in registers at a time
template <int NC, int G>
inline void weighted_sum(const float* p, const float* const* vr, int nb, int nc,
                         const float* corr, float* __restrict o, int d, const float* const* vpf,
                         int npf) {
  const int n = NC > 0 ? NC : nc;
  constexpr int W = G == 1 ? 8 : 24 / G;  // chunks of d held at once: 8 x G accumulators
  for (int c0 = 0; c0 < n; c0 += W) {
    const int w = n - c0 < W ? n - c0 : W;
    v8f acc[G][W];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < w; ++c) acc[g][c] = load8(o + g * d + 8 * (c0 + c)) * corr[g];
    for (int j = 0; j < nb; ++j) {
      if (c0 == 0 && j < npf)
        for (int c = 0; c < n; c += 2) __builtin_prefetch(vpf[j] + 8 * c, 0, 1);
      const float* r = vr[j] + 8 * c0;
      float pj[G];
      for (int g = 0; g < G; ++g) pj[g] = p[g * kKeys + j];
      for (int c = 0; c < w; ++c) {
        const v8f vc = load8(r + 8 * c);
        for (int g = 0; g < G; ++g) acc[g][c] += pj[g] * vc;
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < w; ++c) store8(o + g * d + 8 * (c0 + c), acc[g][c]);
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

// G query heads hq.. (sharing one KV head) against one block of nb keys: scores, the online
// softmax's max and sum per head, and the weighted values into o
template <int NC, int G>
inline void head_block(const float* q, int d, const float* const* kr, const float* const* vr,
                       int nb, float scale, float* s, float* m, float* l, float* o, int hq,
                       const float* const* kpf, const float* const* vpf, int npf) {
  scores<NC, G>(q + (int64_t)hq * d, d, kr, nb, d / 8, scale, s, kpf, npf);
  float corr[G];
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * kKeys;
    const float mb = softmax_block(sg, nb, m[hq + g]);
    corr[g] = m[hq + g] == -INFINITY ? 0.f : exp_approx(m[hq + g] - mb);
    float sum = 0.f;
    for (int j = 0; j < nb; ++j) sum += sg[j];
    l[hq + g] = l[hq + g] * corr[g] + sum;
    m[hq + g] = mb;
  }
  weighted_sum<NC, G>(s, vr, nb, d / 8, corr, o + (int64_t)hq * d, d, vpf, npf);
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
  const float* kpf[kKeys];
  const float* vpf[kKeys];
  float s[kGroup * kKeys];
  for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
    const int nb = (int)(n - j0 < kKeys ? n - j0 : kKeys);
    for (int h = 0; h < kv_heads; ++h) {
      for (int j = 0; j < nb; ++j) {
        kr[j] = k + slots[j0 + j] * row + (int64_t)h * d;
        vr[j] = v + slots[j0 + j] * row + (int64_t)h * d;
      }
      // the rows of the keys kPrefetchKeys ahead, for this KV head, asked for by the first
      // head group's passes
      const int64_t ahead = n - j0 - kPrefetchKeys;
      const int npf = (int)(ahead < kKeys ? (ahead > 0 ? ahead : 0) : kKeys);
      for (int j = 0; j < npf; ++j) {
        kpf[j] = k + slots[j0 + kPrefetchKeys + j] * row + (int64_t)h * d;
        vpf[j] = v + slots[j0 + kPrefetchKeys + j] * row + (int64_t)h * d;
      }
      bool first = true;
      for (int hq = h * group; hq < (h + 1) * group;) {
        const int g = (h + 1) * group - hq < kGroup ? (h + 1) * group - hq : kGroup;
        if (kGroup >= 3 && g == 3)  // (never under AVX2, where kGroup is 1)
          head_block<NC, 3>(q, d, kr, vr, nb, scale, s, m, l, o, hq, kpf, vpf, first ? npf : 0);
        else if (kGroup >= 2 && g == 2)
          head_block<NC, 2>(q, d, kr, vr, nb, scale, s, m, l, o, hq, kpf, vpf, first ? npf : 0);
        else
          head_block<NC, 1>(q, d, kr, vr, nb, scale, s, m, l, o, hq, kpf, vpf, first ? npf : 0);
        hq += g;
        first = false;
      }
    }
  }
}

// A row's chunks (o, m, l each) merged by their maxima into out [heads][d] and lse [heads].
inline void merge_chunks(const float* part, int chunks, int heads, int d, float* out, float* lse) {
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


// How a step's rows are cut into work items: chunks of `chunk` keys (at least one per row,
// about 4 items per thread whatever the rows' lengths); the same for every layer of a step.
struct Split {
  int64_t chunk = 0;
  std::vector<int> first, owner;  // row r's items: first[r] .. first[r + 1]; item -> row
  int items = 0;
  int64_t stride = 0;  // floats of one item's partial result: o [heads][d], m [heads], l [heads]

  Split(const int64_t* offsets, int rows, int heads, int d, int threads) : first(rows + 1, 0) {
    const int64_t total = offsets[rows] - offsets[0];
    chunk = (total + 4 * threads - 1) / (4 * threads);
    chunk = chunk < kMinChunk ? kMinChunk : (chunk + kKeys - 1) / kKeys * kKeys;
    for (int r = 0; r < rows; ++r) {
      const int64_t len = offsets[r + 1] - offsets[r];
      const int n = len > chunk ? (int)((len + chunk - 1) / chunk) : 1;
      first[r + 1] = first[r] + n;
      owner.insert(owner.end(), n, r);
    }
    items = first[rows];
    stride = (int64_t)heads * (d + 2);
  }
};

// Inside a parallel region (orphaned worksharing, so it binds to the caller's team): every
// item's partial result into part [items][stride], then each row merged into out
// [rows][heads][d]. Ends at a barrier.
template <int NC>
void attend_rows(const Split& s, const float* q, const float* k, const float* v,
                 const int64_t* slots, const int64_t* offsets, int rows, int heads, int kv_heads,
                 int d, float scale, float* part, float* out, float* lse) {
#pragma omp for schedule(dynamic, 1)
  for (int it = 0; it < s.items; ++it) {
    const int r = s.owner[it];
    const int64_t j0 = (int64_t)(it - s.first[r]) * s.chunk;
    const int64_t len = offsets[r + 1] - offsets[r];
    const int64_t n = len - j0 < s.chunk ? len - j0 : s.chunk;
    float* p = part + it * s.stride;
    attend_chunk<NC>(q + (int64_t)r * heads * d, k, v, slots + offsets[r] + j0, n, heads,
                     kv_heads, d, scale, p, p + heads * d, p + heads * d + heads);
  }
#pragma omp for schedule(static)
  for (int r = 0; r < rows; ++r)
    merge_chunks(part + s.first[r] * s.stride, s.first[r + 1] - s.first[r], heads, d,
                 out + (int64_t)r * heads * d, lse ? lse + (int64_t)r * heads : nullptr);
}

// Rotate the q and k heads of one row r [(heads + 2 kv_heads) * d] in place by cos / signed
// sin c, s [d] (half-split layout: x * cos + (x2, x1) * ssin); d <= 512.
inline void rope_row(float* r, int heads, int kv_heads, int d, const float* c, const float* s) {
  const int half = d / 2;
  for (int h = 0; h < heads + kv_heads; ++h) {
    float* x = r + (int64_t)h * d;
    float tmp[512];
    for (int i = 0; i < d; ++i) tmp[i] = x[i];
#pragma omp simd
    for (int i = 0; i < half; ++i) x[i] = tmp[i] * c[i] + tmp[i + half] * s[i];
#pragma omp simd
    for (int i = half; i < d; ++i) x[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
  }
}

}  // namespace decode
}  // namespace radixserve
