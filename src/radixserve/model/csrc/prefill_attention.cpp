// Prefill attention, float32: the n query rows of one prompt chunk against its whole context of
// L tokens (the cached part, then the chunk itself; query i sits at position L - n + i and sees
// the keys at positions 0 .. L - n + i), keys and values read from the KV pool by slot.
//
// First the context is copied out of the pool once per call, per KV head: K packed in groups of
// 16 keys, [L/16][d][16], V as [L][d] (rows padded to whole 16s). Then the work items, (KV
// head, block of query tokens), are shared out over the OpenMP threads, the longest first. An
// item's rows are its tokens times the query heads of its KV head (about 96), so every key and
// value it reads serves all of them; it walks the visible keys in blocks of 64: scores
// S = Q K^T and output O += P V as 6 x 16 register tiles (the linear kernel's shape), an online
// softmax in between (running max and sum per row), and the causal mask as a per-row count of
// visible keys, so the blocks past every row's position are never computed; in the block holding
// the item's diagonal, a 16-key group's scores start at the first row that sees one of its keys
// and each 6-row tile's P V stops at its last row's count (the masked triangle's work, about 3% of
// a 1,024-token chunk without cached context, is skipped). The softmax runs in
// base 2 (the queries pre-scaled by log2(e)): each weight is one exp2_8, two thirds of exp8's
// vector ops, and a masked key's -inf comes out of it as exactly 0. A row's max and sum are
// reduced by shuffles, and the rescaling of the rows' earlier blocks, 2^(old max - new max),
// runs 8 rows at a time after the block (a scalar exp2 per row and block before: 1.06-1.10x).
//
// Built with cpu_kernels.cpp into one library by radixserve.model.kernels.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>

#include "vec.h"

namespace {

using radixserve::exp2_8;
using radixserve::load8;
using radixserve::store8;
using radixserve::v8f;

constexpr int kLane = 16;        // keys per packed K group; output columns per tile
constexpr int kKeys = 64;        // keys per block
constexpr int kTargetRows = 96;  // query rows (tokens x heads of one KV head) per item

// c[R][16] = a[R][K] b[K][16], or with Acc c = c * cs[r] + a b (a: row stride lda; b, c: ldb,
// ldc)
template <int R, bool Acc, int KC>
inline void tile(const float* __restrict a, int lda, const float* __restrict b, int ldb, int K,
                 float* __restrict c, int ldc, const float* __restrict cs) {
  if constexpr (KC > 0) K = KC;
  v8f c0[R], c1[R];
  for (int r = 0; r < R; ++r) {
    if (Acc) {
      c0[r] = load8(c + r * ldc) * cs[r];
      c1[r] = load8(c + r * ldc + 8) * cs[r];
    } else {
      c0[r] = c1[r] = v8f{};
    }
  }
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) {
    const v8f b0 = load8(b + (int64_t)k * ldb), b1 = load8(b + (int64_t)k * ldb + 8);
    for (int r = 0; r < R; ++r) {
      const float s = a[r * lda + k];
      c0[r] += b0 * s;
      c1[r] += b1 * s;
    }
  }
  for (int r = 0; r < R; ++r) {
    store8(c + r * ldc, c0[r]);
    store8(c + r * ldc + 8, c1[r]);
  }
}

// `tile` over `rows` rows: 6 at a time, then the rest (KC > 0: K known at compile time)
template <bool Acc, int KC>
void tiles_k(const float* a, int lda, const float* b, int ldb, int K, float* c, int ldc,
           const float* cs, int rows) {
  int r = 0;
  for (; r + 6 <= rows; r += 6)
    tile<6, Acc, KC>(a + r * lda, lda, b, ldb, K, c + r * ldc, ldc, cs + r);
  const float* a1 = a + r * lda;
  float* c1 = c + r * ldc;
  switch (rows - r) {
    case 5: tile<5, Acc, KC>(a1, lda, b, ldb, K, c1, ldc, cs + r); break;
    case 4: tile<4, Acc, KC>(a1, lda, b, ldb, K, c1, ldc, cs + r); break;
    case 3: tile<3, Acc, KC>(a1, lda, b, ldb, K, c1, ldc, cs + r); break;
    case 2: tile<2, Acc, KC>(a1, lda, b, ldb, K, c1, ldc, cs + r); break;
    case 1: tile<1, Acc, KC>(a1, lda, b, ldb, K, c1, ldc, cs + r); break;
    default: break;
  }
}

// tiles_k with K = 64 (a head dim of 64; a whole block of keys) compiled as a constant: the
// loop unrolled, its addresses immediate (1.03-1.04x on SmolLM2's head dim 64)
template <bool Acc>
void tiles(const float* a, int lda, const float* b, int ldb, int K, float* c, int ldc,
           const float* cs, int rows) {
  if (K == 64)
    tiles_k<Acc, 64>(a, lda, b, ldb, K, c, ldc, cs, rows);
  else
    tiles_k<Acc, 0>(a, lda, b, ldb, K, c, ldc, cs, rows);
}

struct Call {  // one call's operands
  const float* q;
  int64_t q_stride;  // floats between query tokens
  int n, L, heads, kv_heads, d, dp, group, tokens_per_item;  // dp: d rounded up to 16
  const float* kt;  // [kv_heads][L/16][d][16]
  const float* vc;  // [kv_heads][L][dp], columns past d zero
  int64_t head_floats;  // one KV head's floats in kt and in vc
  float scale;
  float* out;  // [n][heads][d]
};

struct Scratch {  // one item's rows: scaled queries, running output, scores, softmax state
  std::vector<float> q, o, s, m, l, corr, rowsum;  // m .. rowsum: rows padded to whole 8s
  Scratch(int rows, int d)
      : q(rows * d), o(rows * ((d + kLane - 1) / kLane * kLane)), s(rows * kKeys),
        m(pad8(rows)), l(pad8(rows)), corr(pad8(rows)), rowsum(pad8(rows)) {}
  static int pad8(int n) { return (n + 7) / 8 * 8; }
};

// copy the context's K (packed) and V of every KV head out of the pool
void pack_context(const float* k, const float* v, const int64_t* slots, const Call& c,
                  float* kt, float* vc, int threads) {
  const int groups = (c.L + kLane - 1) / kLane;
  const int64_t row = (int64_t)c.kv_heads * c.d;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int it = 0; it < c.kv_heads * groups; ++it) {
    const int h = it / groups, g = it % groups;
    float* kg = kt + h * c.head_floats + (int64_t)g * c.d * kLane;
    for (int j = 0; j < kLane; ++j) {
      const int key = g * kLane + j;
      if (key >= c.L) {
        for (int i = 0; i < c.d; ++i) kg[i * kLane + j] = 0.f;
        continue;
      }
      const float* kr = k + slots[key] * row + (int64_t)h * c.d;
      for (int i = 0; i < c.d; ++i) kg[i * kLane + j] = kr[i];
      float* vr = vc + h * c.head_floats + (int64_t)key * c.dp;
      std::memcpy(vr, v + slots[key] * row + (int64_t)h * c.d, sizeof(float) * c.d);
      for (int i = c.d; i < c.dp; ++i) vr[i] = 0.f;
    }
  }
}

inline float hmax8(v8f v) {
  v8f t = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v = v > t ? v : t;
  t = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v = v > t ? v : t;
  return v[0] > v[1] ? v[0] : v[1];
}

inline float hsum8(v8f v) {
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  return v[0] + v[1];
}

// softmax of one block's scores, row by row, in place (S becomes P): a row sees its first
// `visible` keys of the block's nk (the scores were computed for whole groups of 16); then each
// row's correction of its earlier blocks, 2^(old max - new max), 8 rows at a time (an old max of
// -inf, before the first block, gives exactly 0)
void block_softmax(Scratch& w, int rows, int nk, int p0, int kb, int group) {
  const int width = (nk + kLane - 1) / kLane * kLane;
  for (int r = 0; r < rows; ++r) {
    float* s = w.s.data() + r * kKeys;
    int visible = p0 + r / group + 1 - kb;
    visible = visible < 0 ? 0 : (visible > nk ? nk : visible);
    for (int j = visible; j < width; ++j) s[j] = -INFINITY;
    v8f vm = load8(s);
    for (int j = 8; j < width; j += 8) {
      const v8f x = load8(s + j);
      vm = x > vm ? x : vm;
    }
    const float top = hmax8(vm), mb = top > w.m[r] ? top : w.m[r];
    v8f sum = v8f{};
    for (int j = 0; j < width; j += 8) {
      const v8f p = exp2_8(load8(s + j) - mb);  // a masked key's -inf: 0
      store8(s + j, p);
      sum += p;
    }
    w.corr[r] = w.m[r];  // the old max, for the pass below
    w.m[r] = mb;
    w.rowsum[r] = hsum8(sum);
  }
  for (int r = 0; r < rows; r += 8) {  // the scratch rows are padded to whole 8s
    const v8f corr = exp2_8(load8(&w.corr[r]) - load8(&w.m[r]));
    store8(&w.corr[r], corr);
    store8(&w.l[r], load8(&w.l[r]) * corr + load8(&w.rowsum[r]));
  }
}

// O += P V over the block holding the item's diagonal, 6 rows at a time, each tile's keys cut
// at its last row's visible count (its other rows' weights past their own count are 0): the
// masked triangle is not multiplied. first: the first row's visible keys
void diagonal_pv(Scratch& w, const float* v, int dp, int rows, int nk, int first, int group) {
  for (int r = 0; r < rows; r += 6) {
    const int rt = rows - r < 6 ? rows - r : 6;
    const int k = std::max(0, std::min(nk, first + (r + rt - 1) / group));
    for (int col = 0; col < dp; col += kLane)
      tiles_k<true, 0>(w.s.data() + r * kKeys, kKeys, v + col, dp, k, w.o.data() + r * dp + col,
                       dp, w.corr.data() + r, rt);
  }
}

// one item: KV head h, query tokens t0 .. t0 + nt - 1
void one_item(const Call& c, int h, int t0, Scratch& w) {
  const int nt = c.n - t0 < c.tokens_per_item ? c.n - t0 : c.tokens_per_item;
  const int rows = nt * c.group, d = c.d, dp = c.dp;
  const float qscale = c.scale * 1.44269504088896341f;  // scores in base 2: softmax by exp2
  for (int t = 0; t < nt; ++t)
    for (int g = 0; g < c.group; ++g) {
      const float* qr = c.q + (int64_t)(t0 + t) * c.q_stride + (int64_t)(h * c.group + g) * d;
      float* dst = w.q.data() + (t * c.group + g) * d;
      for (int i = 0; i < d; ++i) dst[i] = qr[i] * qscale;
    }
  std::fill(w.o.begin(), w.o.begin() + rows * dp, 0.f);
  std::fill(w.m.begin(), w.m.end(), -INFINITY);  // padding rows too (never read out)
  std::fill(w.l.begin(), w.l.end(), 0.f);
  const int p0 = c.L - c.n + t0, end = p0 + nt;  // keys 0 .. end - 1 are visible to some row
  const float* kt = c.kt + h * c.head_floats;
  const float* vc = c.vc + h * c.head_floats;
  for (int kb = 0; kb < end; kb += kKeys) {
    const int nk = end - kb < kKeys ? end - kb : kKeys;
    for (int g = 0; g * kLane < nk; ++g) {  // rows before r0 see none of the group's keys
      const int r0 = std::max(0, (kb + g * kLane - p0) * c.group);
      if (r0 >= rows) break;  // no row of this item sees this group or any after it yet
      tiles<false>(w.q.data() + r0 * d, d, kt + (int64_t)(kb / kLane + g) * d * kLane, kLane, d,
                   w.s.data() + r0 * kKeys + g * kLane, kKeys, nullptr, rows - r0);
    }
    block_softmax(w, rows, nk, p0, kb, c.group);
    if (p0 + 1 - kb >= nk) {  // every row sees the whole block
      for (int col = 0; col < dp; col += kLane)
        tiles<true>(w.s.data(), kKeys, vc + (int64_t)kb * dp + col, dp, nk, w.o.data() + col, dp,
                    w.corr.data(), rows);
    } else {
      diagonal_pv(w, vc + (int64_t)kb * dp, dp, rows, nk, p0 + 1 - kb, c.group);
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int t = r / c.group, g = r % c.group;
    float* dst = c.out + ((int64_t)(t0 + t) * c.heads + h * c.group + g) * d;
    const float inv = 1.f / w.l[r];
    for (int i = 0; i < d; ++i) dst[i] = w.o[r * dp + i] * inv;
  }
}

}  // namespace

extern "C" {

// q: [n] query tokens of `heads` heads of dim d, `q_stride` floats apart; k, v: one layer of
// the pool, [slots, kv_heads, d]; slots [L]: the context's pool slots in position order (the
// chunk's own last); out [n, heads, d]. Returns 0, or -1 when the shapes are not supported
// (d over 256, heads not a multiple of kv_heads or over 96 per KV head, n > L).
int radixserve_prefill_attention_f32(const float* q, int64_t q_stride, int n, const float* k,
                                     const float* v, const int64_t* slots, int L, int heads,
                                     int kv_heads, int d, float scale, float* out, int threads) {
  if (d <= 0 || d > 256 || kv_heads <= 0 || heads % kv_heads != 0 || n > L ||
      heads / kv_heads > kTargetRows)
    return -1;
  if (threads < 1) threads = 1;
  const int group = heads / kv_heads;
  const int dp = (d + kLane - 1) / kLane * kLane;
  const int64_t head_floats = (int64_t)(L + kLane - 1) / kLane * kLane * dp;
  thread_local std::vector<float> ctx;  // reused across calls: no page faults per layer
  if (ctx.size() < (size_t)(2 * kv_heads * head_floats)) ctx.resize(2 * kv_heads * head_floats);
  const int per_item = kTargetRows / group;
  Call c{q, q_stride, n, L, heads, kv_heads, d, dp, group, per_item, ctx.data(),
         ctx.data() + kv_heads * head_floats, head_floats, scale, out};
  pack_context(k, v, slots, c, ctx.data(), ctx.data() + kv_heads * head_floats, threads);
  const int blocks = (n + per_item - 1) / per_item;
#pragma omp parallel num_threads(threads)
  {
    Scratch w(per_item * group, d);
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < blocks * kv_heads; ++it)  // the last blocks see the most keys: first
      one_item(c, it % kv_heads, (blocks - 1 - it / kv_heads) * per_item, w);
  }
  return 0;
}
}
