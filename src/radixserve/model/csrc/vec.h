// The vector type and exp both kernel files use: GCC vector extensions, so the code compiles
// to the machine's widest float unit under -march=native (AVX2 + FMA here) without intrinsics.
#pragma once

#include <cmath>
#include <cstdint>

namespace radixserve {

typedef float v8f __attribute__((vector_size(32)));  // 8 floats: one AVX register (two on SSE)
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, v8f v) { __builtin_memcpy(p, &v, sizeof(v)); }

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

// exp_approx on 8 lanes at once, written out for the vector unit (the loops calling
// exp_approx are left scalar by GCC where it cannot vectorize nearbyint): rounding by adding and
// subtracting 1.5 * 2^23, the same polynomial.
inline v8f exp8(v8f x) {
  const v8f lo = v8f{} - 87.f, hi = v8f{} + 88.f, round = v8f{} + 12582912.f;
  x = x < lo ? lo : (x > hi ? hi : x);
  const v8f n = (x * 1.44269504088896341f + round) - round;
  v8f r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  v8f p = v8f{} + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  return p * (v8f)bits;
}

// 2^x on 8 lanes for x <= 0, the softmax's exponent when its scores are kept in base 2 (the
// queries pre-scaled by log2(e)): x rounds to n + r, r in [-1/2, 1/2], and 2^r is a degree-5
// polynomial (relative error under 4e-7), about 12 vector ops to exp8's 18. x is clamped at
// -127, where the exponent field 2^n comes out 0: a masked score (-inf) gives exactly 0.
inline v8f exp2_8(v8f x) {
  const v8f lo = v8f{} - 127.f, round = v8f{} + 12582912.f;  // 1.5 * 2^23
  x = x < lo ? lo : x;
  const v8f t = x + round;  // n in the low mantissa bits of t
  const v8f r = x - (t - round);
  v8f p = v8f{} + 1.2915670e-3f;
  p = p * r + 9.6685309e-3f;
  p = p * r + 5.5516887e-2f;
  p = p * r + 2.4022265e-1f;
  p = p * r + 6.9314647e-1f;
  p = p * r + 1.f;
  // t's bits are 0x4B400000 + n; the shift drops the constant, leaving (n + 127) << 23
  const v8i bits = ((v8i)t + 127) << 23;
  return p * (v8f)bits;
}

}  // namespace radixserve
