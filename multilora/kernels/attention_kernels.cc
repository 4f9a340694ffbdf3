// Decode attention for the CPU, reading the paged KV cache in place.
//
// XLA's CPU backend runs the decode step's attention (multilora/model/attention.py,
// decode_attention) as a gather that copies every page of the step out of the cache, for every
// layer, before two small batched products. This kernel walks each decode row's pages straight
// in the whole (L, P, p, K, H) cache at the layer given as an operand (so the scan over layers
// copies nothing), and stops at the row's own position: the work is the keys each row sees.
//
// For decode row b < num_decode (its pages: the run of kv_pages_X tagged b in kv_page_seq_X, in
// order, so key j of the row sits in page kv_pages_X[start_b + j / p] at offset j % p), each kv
// head k and each of its G query heads g (query head k * G + g):
//   out[b, k*G + g] = sum_j softmax_j(q[b, k*G+g] . K[j, k] / sqrt(H)) V[j, k]
// over keys j <= positions_T[b] (and j > positions_T[b] - sliding_window when a window is set).
// Rows from num_decode on, and rows that see no key, are zeros.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using multilora::clamp_layer;
using multilora::parallel_items;

// One work item: a decode row, all its heads (each key's K/V for all kv heads is one contiguous
// run of K * H floats, so a row's pages stream through the cache whole).
struct Row {
  int64_t row, start, keys, first;  // first: the first visible key (sliding window)
};

// Eight floats in a register (AVX2's ymm, two SSE or NEON registers elsewhere): GCC/Clang vector
// extensions, so the source stays portable and -march=native picks the instructions.
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
constexpr int64_t kW = 8;

inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, f8 v) { std::memcpy(p, &v, sizeof v); }
inline f8 splat(float x) { return f8{x, x, x, x, x, x, x, x}; }
inline float hsum(f8 v) {
  float s = 0.f;
  for (int i = 0; i < kW; ++i) s += v[i];
  return s;
}

// exp of eight floats to ~2 ulp: 2^n * e^r with n = round(x / ln 2), |r| <= ln(2) / 2, e^r by
// its degree-6 Taylor polynomial (relative error < 2e-7 there). x is clamped to [-87, 88]: the
// softmax only asks for x <= 0, where exp(-87) ~ 1.6e-38 stands in for 0.
inline f8 exp8(f8 x) {
  const f8 lo = splat(-87.f), hi = splat(88.f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const f8 magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const f8 n = (x * splat(1.44269504f) + magic) - magic;
  const f8 r = (x - n * splat(0.693145752f)) - n * splat(1.42860677e-6f);
  f8 poly = splat(1.f / 720);
  poly = poly * r + splat(1.f / 120);
  poly = poly * r + splat(1.f / 24);
  poly = poly * r + splat(1.f / 6);
  poly = poly * r + splat(0.5f);
  poly = poly * r + splat(1.f);
  poly = poly * r + splat(1.f);
  const i8 bits = (__builtin_convertvector(n, i8) + 127) << 23;
  f8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return poly * scale;
}

inline float exp1(float x) {
  f8 v = exp8(splat(x));
  return v[0];
}

// q . k over H floats.
inline float dot(const float* __restrict q, const float* __restrict k, int64_t H) {
  f8 acc = splat(0.f);
  int64_t i = 0;
  for (; i + kW <= H; i += kW) acc += load8(q + i) * load8(k + i);
  float s = hsum(acc);
  for (; i < H; ++i) s += q[i] * k[i];
  return s;
}

// Scores s_Rn (row r: one query head against n keys) become softmax weights, row by row.
void softmax_rows(float* s, int64_t R, int64_t n) {
  for (int64_t g = 0; g < R; ++g) {
    float* sg = s + g * n;
    const float m = *std::max_element(sg, sg + n);
    f8 lsum = splat(0.f);
    int64_t j = 0;
    for (; j + kW <= n; j += kW) {
      const f8 e = exp8(load8(sg + j) - splat(m));
      store8(sg + j, e);
      lsum += e;
    }
    float l = hsum(lsum);
    for (; j < n; ++j) l += (sg[j] = exp1(sg[j] - m));
    const float inv = 1.f / l;
    for (j = 0; j < n; ++j) sg[j] *= inv;
  }
}

// acc_H += w * v_H.
inline void axpy(float* __restrict acc, float w, const float* __restrict v, int64_t H) {
  const f8 w8 = splat(w);
  int64_t i = 0;
  for (; i + kW <= H; i += kW) store8(acc + i, load8(acc + i) + w8 * load8(v + i));
  for (; i < H; ++i) acc[i] += w * v[i];
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q_TNH, ffi::Buffer<ffi::F32> k_LPpKH,
                           ffi::Buffer<ffi::F32> v_LPpKH, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> kv_pages_X, ffi::Buffer<ffi::S32> kv_page_seq_X,
                           ffi::Buffer<ffi::S32> positions_T, ffi::Buffer<ffi::S32> num_decode,
                           ffi::ResultBuffer<ffi::F32> out_TNH, int64_t sliding_window) {
  auto qd = q_TNH.dimensions();
  auto cd = k_LPpKH.dimensions();
  auto vd = v_LPpKH.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || vd.size() != 5 || !std::equal(cd.begin(), cd.end(), vd.begin()) ||
      cd[4] != qd[2] || cd[3] <= 0 ||
      qd[1] % cd[3] || kv_page_seq_X.element_count() != kv_pages_X.element_count() ||
      positions_T.element_count() != qd[0])
    return ffi::Error::InvalidArgument("multilora decode attention: operand shapes disagree");
  const int64_t T = qd[0], N = qd[1], H = qd[2];
  const int64_t L = cd[0], P = cd[1], p = cd[2], K = cd[3], G = N / K;
  const int64_t X = kv_pages_X.element_count();
  const int64_t B = std::clamp<int64_t>(num_decode.typed_data()[0], 0, T);
  const int64_t lay = clamp_layer(layer.typed_data()[0], L);
  const float* q = q_TNH.typed_data();
  const float* kc = k_LPpKH.typed_data() + lay * P * p * K * H;
  const float* vc = v_LPpKH.typed_data() + lay * P * p * K * H;
  const int32_t* pages = kv_pages_X.typed_data();
  const int32_t* page_seq = kv_page_seq_X.typed_data();
  const int32_t* pos = positions_T.typed_data();
  float* out = out_TNH->typed_data();
  std::memset(out, 0, sizeof(float) * T * N * H);

  // Each decode row's run of pages (kv_page_seq_X ascends; other sequences' and padding pages
  // are skipped).
  std::vector<int64_t> start(B, -1), count(B, 0);
  for (int64_t x = 0; x < X; ++x) {
    const int64_t s = page_seq[x];
    if (s < 0 || s >= B) continue;
    if (start[s] < 0) start[s] = x;
    count[s]++;
  }
  std::vector<Row> items;
  items.reserve(B);
  for (int64_t b = 0; b < B; ++b) {
    if (start[b] < 0 || pos[b] < 0) continue;
    const int64_t keys = std::min<int64_t>(count[b] * p, int64_t{pos[b]} + 1);
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, pos[b] - sliding_window + 1) : 0;
    if (keys <= first) continue;
    items.push_back(Row{b, start[b], keys, first});
  }
  const float scale = 1.f / std::sqrt(static_cast<float>(H));
  const int64_t row_stride = K * H;  // floats between one slot and the next within a page

  parallel_items(pool, items, [&](const Row& it) {
    const int64_t n = it.keys - it.first;
    thread_local std::vector<float> s;      // scores, then weights: N rows of n keys
    thread_local std::vector<int64_t> off;  // each key's slot in the layer's cache (floats)
    s.resize(N * n);
    off.resize(n);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t key = it.first + j;
      const int64_t page = std::clamp<int64_t>(pages[it.start + key / p], 0, P - 1);
      off[j] = (page * p + key % p) * row_stride;
    }
    const float* qr = q + it.row * N * H;
    for (int64_t j = 0; j < n; ++j) {
      const float* krow = kc + off[j];
      for (int64_t h = 0; h < N; ++h) s[h * n + j] = dot(qr + h * H, krow + (h / G) * H, H) * scale;
    }
    softmax_rows(s.data(), N, n);
    float* acc = out + it.row * N * H;  // zeroed above
    for (int64_t j = 0; j < n; ++j) {
      const float* vrow = vc + off[j];
      for (int64_t h = 0; h < N; ++h) axpy(acc + h * H, s[h * n + j], vrow + (h / G) * H, H);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiloraDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("sliding_window"));
