// A whole decode step of a dense Llama-family model in one call, float32: every decoder layer
// (norm, qkv, rope + K/V store, attention over the pool, o-proj + residual, norm, gate/up,
// silu * up, down + residual) for B rows of one new token each, inside one OpenMP parallel
// region.
//
// Why: called op by op from Python, a decode step of SmolLM2-135M is 30 layers x 8 calls, each
// its own Python dispatch and its own parallel region (240 thread wake-ups a step, 6-9 ms of a
// 64 ms step here). Here a layer is 7 barriers of one team. The norms are computed by every
// thread for itself (B x hidden floats, cheaper than a barrier); each linear shares out whole
// column blocks of the packed weights (cpu_kernels.cpp's layout), and o-proj and down add their
// results into the residual in place (a thread owns its columns); gate and up blocks of the
// same columns go to the same thread, which applies silu(gate) * up while they are in
// registers' reach. Attention is decode_attention.h's, its work split planned once a step.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>

#include <vector>

#include "decode_attention.h"
#include "linear_tile.h"
#include "rms_norm.h"
#include "vec.h"

namespace {

using radixserve::kCols;  // the linear's tile and its packed blocks (linear_tile.h)
using radixserve::kTilesOf;
using radixserve::silu_mul_block;
using radixserve::load8;
using radixserve::store8;
using radixserve::v8f;
using radixserve::v8i;
using radixserve::decode::attend_rows;
using radixserve::decode::rope_row;
using radixserve::decode::Split;

constexpr int kMaxRows = 8;  // rows of x one tile takes

// One column block b of y [M][N] (+)= x [M][K] W^T, 8 rows at a time (more than 8 rows read
// the block again, from cache).
template <bool Acc>
void block_rows(const float* x, int M, int K, const float* packed, int N, int b, float* y,
                const float* bias) {
  const float* w = packed + (int64_t)b * K * kCols;
  const int ncols = N - b * kCols < kCols ? N - b * kCols : kCols;
  for (int m = 0; m < M; m += kMaxRows) {
    const int r = M - m < kMaxRows ? M - m : kMaxRows;
    kTilesOf<true, Acc>[r](x + (int64_t)m * K, w, K, y + (int64_t)m * N + b * kCols, N, ncols,
                     bias ? bias + b * kCols : nullptr);
  }
}

// y (+)= x W^T over the team: whole column blocks per thread; ends at a barrier
template <bool Acc>
void linear(const float* x, int M, int K, const float* packed, int N, float* y,
            const float* bias) {
  const int blocks = (N + kCols - 1) / kCols;
#pragma omp for schedule(static)
  for (int b = 0; b < blocks; ++b) block_rows<Acc>(x, M, K, packed, N, b, y, bias);
}

// act [M][I] = silu(gate) * up, gate_up packed [2I/16][K][16] (I a multiple of 16): gate
// block j and up block I/16 + j by the same thread, straight into act; ends at a barrier
void gate_up_act(const float* x, int M, int K, const float* packed, int I, float* act) {
  const int blocks = I / kCols;
#pragma omp for schedule(static)
  for (int j = 0; j < blocks; ++j) {
    for (int m = 0; m < M; m += kMaxRows) {
      const int r = M - m < kMaxRows ? M - m : kMaxRows;
      float g[kMaxRows * kCols], u[kMaxRows * kCols];
      const float* xm = x + (int64_t)m * K;
      kTilesOf<true, false>[r](xm, packed + (int64_t)j * K * kCols, K, g, kCols, kCols, nullptr);
      kTilesOf<true, false>[r](xm, packed + (int64_t)(blocks + j) * K * kCols, K, u, kCols, kCols,
                         nullptr);
      silu_mul_block(g, u, r, act + (int64_t)m * I + j * kCols, I);
    }
  }
}

// y [M][H] = x / sqrt(mean(x^2) + eps) * w, per row (the calling thread alone)
void rms_rows(const float* x, int M, int H, const float* w, float eps, float* y) {
  for (int t = 0; t < M; ++t)
    radixserve::rms_norm_row(x + (int64_t)t * H, w, H, eps, y + (int64_t)t * H);
}

// A layer's weights, as the pointers of the table the caller passes (one row of kFields
// per layer, int64 addresses; a bias may be 0).
enum Field { kInNorm, kQkv, kQkvBias, kO, kOBias, kPostNorm, kGateUp, kDown, kFields };

struct Shape {
  int B, H, heads, kv_heads, d, inter;
  float eps, scale;
  int qkv_width() const { return (heads + 2 * kv_heads) * d; }
};

struct Buffers {
  std::vector<float> q, qkv, attn, act, part;
};

// One decoder layer inside the parallel region; `h` is this thread's own norm buffer.
template <int NC>
void layer(const Shape& s, const int64_t* w, float* x, float* h, Buffers& buf, const float* cos,
           const float* ssin, const int64_t* write_slots, float* k_pool, float* v_pool,
           const Split& split, const int64_t* slots, const int64_t* offsets) {
  auto ptr = [&](Field f) { return reinterpret_cast<const float*>(w[f]); };
  const int qw = s.qkv_width();
  const int64_t kv_width = (int64_t)s.kv_heads * s.d;
  rms_rows(x, s.B, s.H, ptr(kInNorm), s.eps, h);
  linear<false>(h, s.B, s.H, ptr(kQkv), qw, buf.qkv.data(), ptr(kQkvBias));
#pragma omp for schedule(static)
  for (int t = 0; t < s.B; ++t) {
    float* r = buf.qkv.data() + (int64_t)t * qw;
    rope_row(r, s.heads, s.kv_heads, s.d, cos + (int64_t)t * s.d, ssin + (int64_t)t * s.d);
    const int64_t slot = write_slots[t];
    std::memcpy(k_pool + slot * kv_width, r + (int64_t)s.heads * s.d, sizeof(float) * kv_width);
    std::memcpy(v_pool + slot * kv_width, r + (int64_t)(s.heads + s.kv_heads) * s.d,
                sizeof(float) * kv_width);
    // attention reads q rows [heads][d] at a stride of heads * d
    std::memcpy(buf.q.data() + (int64_t)t * s.heads * s.d, r, sizeof(float) * s.heads * s.d);
  }
  attend_rows<NC>(split, buf.q.data(), k_pool, v_pool, slots, offsets, s.B, s.heads, s.kv_heads,
                  s.d, s.scale, buf.part.data(), buf.attn.data(), nullptr);
  linear<true>(buf.attn.data(), s.B, s.heads * s.d, ptr(kO), s.H, x, ptr(kOBias));
  rms_rows(x, s.B, s.H, ptr(kPostNorm), s.eps, h);
  gate_up_act(h, s.B, s.H, ptr(kGateUp), s.inter, buf.act.data());
  linear<true>(buf.act.data(), s.B, s.inter, ptr(kDown), s.H, x, nullptr);
}

template <int NC>
void all_layers(const Shape& s, int layers, const int64_t* table, float* x, const float* cos,
                const float* ssin, const int64_t* write_slots, float* kv, int64_t layer_stride,
                int64_t kv_stride, const int64_t* slots, const int64_t* offsets, int threads) {
  const Split split(offsets, s.B, s.heads, s.d, threads);
  Buffers buf;
  buf.q.resize((size_t)s.B * s.heads * s.d);
  buf.qkv.resize((size_t)s.B * s.qkv_width());
  buf.attn.resize((size_t)s.B * s.heads * s.d);
  buf.act.resize((size_t)s.B * s.inter);
  buf.part.resize((size_t)split.items * split.stride);
  std::vector<float> norms((size_t)threads * s.B * s.H);
#pragma omp parallel num_threads(threads)
  {
    float* h = norms.data() + (size_t)omp_get_thread_num() * s.B * s.H;
    for (int l = 0; l < layers; ++l) {
      float* k_pool = kv + l * layer_stride;
      layer<NC>(s, table + (int64_t)l * kFields, x, h, buf, cos, ssin, write_slots, k_pool,
                k_pool + kv_stride, split, slots, offsets);
    }
  }
}

}  // namespace

extern "C" {

// Fields of one layer's row in the table radixserve_decode_layers_f32 takes.
int radixserve_decode_layer_fields() { return kFields; }

// B decode rows through `layers` decoder layers: x [B, H] (the embeddings in, the last layer's
// hidden states out, before the final norm). table [layers][kFields]: the addresses of each
// layer's input norm [H], packed qkv [(heads + 2 kv_heads) d, H], its bias or 0, packed o
// [H, heads d], its bias or 0, post norm [H], packed gate_up [2 inter, H] (gate rows first),
// packed down [H, inter]. cos / ssin [B, d] (rope.cos_sin's half-split form); row t's K/V are
// stored at pool slot write_slots[t] of layer l's K at kv + l * layer_stride and V kv_stride
// floats further ([slots, kv_heads, d] each); row t attends slots[offsets[t] .. offsets[t+1]),
// its own slot included. Returns 0, or -1 when the shapes are not supported.
int radixserve_decode_layers_f32(float* x, int B, int H, int layers, const int64_t* table,
                                 int heads, int kv_heads, int d, int inter, float eps,
                                 float scale, const float* cos, const float* ssin,
                                 const int64_t* write_slots, float* kv, int64_t layer_stride,
                                 int64_t kv_stride, const int64_t* slots,
                                 const int64_t* offsets, int threads) {
  if (B < 1 || kv_heads <= 0 || heads % kv_heads != 0 || d % 8 != 0 || d > 512 ||
      inter % kCols != 0)
    return -1;
  if (threads < 1) threads = 1;
  const Shape s{B, H, heads, kv_heads, d, inter, eps, scale};
  if (d == 64)
    all_layers<8>(s, layers, table, x, cos, ssin, write_slots, kv, layer_stride, kv_stride, slots,
                  offsets, threads);
  else if (d == 128)
    all_layers<16>(s, layers, table, x, cos, ssin, write_slots, kv, layer_stride, kv_stride,
                   slots, offsets, threads);
  else
    all_layers<0>(s, layers, table, x, cos, ssin, write_slots, kv, layer_stride, kv_stride, slots,
                  offsets, threads);
  return 0;
}
}

// ---- greedy choice -----------------------------------------------------------------------------
extern "C" {

// out[r] = the index of the largest of row r of x [rows, n] (row stride ld floats): the first
// one where several are equal, the first NaN where there is one (torch.argmax's answer). One
// thread: a decode step's few rows of logits are read in well under a millisecond, less than
// waking a team costs (torch's argmax over 8 x 49,152 took 0.5 ms on one thread here, 9 ms on
// two beside a busy neighbour).
void radixserve_argmax_f32(const float* x, int rows, int n, int64_t ld, int64_t* out) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + (int64_t)r * ld;
    v8f mv = v8f{} - INFINITY;
    v8i nanv = {};
    int i = 0;
    for (; i + 8 <= n; i += 8) {
      const v8f v = load8(xr + i);
      nanv |= v != v;
      mv = v > mv ? v : mv;
    }
    float m = -INFINITY;
    bool nan = false;
    for (int j = 0; j < 8; ++j) m = mv[j] > m ? mv[j] : m, nan |= nanv[j] != 0;
    for (int k = i; k < n; ++k) {
      nan |= xr[k] != xr[k];
      m = xr[k] > m ? xr[k] : m;
    }
    int64_t at = 0;
    for (int k = 0; k < n; ++k)
      if (nan ? xr[k] != xr[k] : xr[k] == m) {
        at = k;
        break;
      }
    out[r] = at;
  }
}
}
