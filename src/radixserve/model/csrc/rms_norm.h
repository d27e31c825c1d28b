// One row of RMS norm, float32: cpu_kernels.cpp's op-by-op norm (the residual add fused in)
// and decode_layers.cpp's one-call decode step (without it) both run these.
#pragma once

#include <cmath>

namespace radixserve {

// y = x * inv * w over one row of H floats
inline void scale_row(const float* x, float inv, const float* w, int H, float* y) {
#pragma omp simd
  for (int i = 0; i < H; ++i) y[i] = x[i] * inv * w[i];
}

// y = x / sqrt(mean(x^2) + eps) * w over one row of H floats
inline void rms_norm_row(const float* x, const float* w, int H, float eps, float* y) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int i = 0; i < H; ++i) ss += x[i] * x[i];
  scale_row(x, 1.f / std::sqrt(ss / (float)H + eps), w, H, y);
}

// Optionally x += delta (in place, in the pass that sums the squares), then rms_norm_row.
inline void add_rms_norm_row(float* x, const float* delta, const float* w, int H, float eps,
                             float* y) {
  if (delta == nullptr) return rms_norm_row(x, w, H, eps, y);
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int i = 0; i < H; ++i) {
    x[i] += delta[i];
    ss += x[i] * x[i];
  }
  scale_row(x, 1.f / std::sqrt(ss / (float)H + eps), w, H, y);
}

}  // namespace radixserve
