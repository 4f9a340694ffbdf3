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

// Where each sequence s < S has its run of pages in the step's flat list (kv_page_seq_X ascends:
// one run per sequence, in order): its first index (-1: none) and its length. Other ids (padding)
// are skipped.
void page_runs(const int32_t* page_seq, int64_t X, int64_t S, std::vector<int64_t>& start,
               std::vector<int64_t>& count) {
  start.assign(S, -1);
  count.assign(S, 0);
  for (int64_t x = 0; x < X; ++x) {
    const int64_t s = page_seq[x];
    if (s < 0 || s >= S) continue;
    if (start[s] < 0) start[s] = x;
    count[s]++;
  }
}

// The operands both attention kernels share, checked and unpacked: the cache pointers at the
// layer, the step's flat page list, and the output (zeroed). False when their shapes disagree.
struct Paged {
  int64_t T, N, H, P, p, K, G, X;
  const float *q, *kc, *vc;
  const int32_t *pages, *page_seq, *pos;
  float* out;
};

bool unpack(ffi::Buffer<ffi::F32> q_TNH, ffi::Buffer<ffi::F32> k_LPpKH, ffi::Buffer<ffi::F32> v_LPpKH,
            ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_pages_X, ffi::Buffer<ffi::S32> kv_page_seq_X,
            ffi::Buffer<ffi::S32> positions_T, ffi::ResultBuffer<ffi::F32>& out_TNH, Paged& a) {
  auto qd = q_TNH.dimensions();
  auto cd = k_LPpKH.dimensions();
  auto vd = v_LPpKH.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || vd.size() != 5 || !std::equal(cd.begin(), cd.end(), vd.begin()) ||
      cd[4] != qd[2] || cd[3] <= 0 || qd[1] % cd[3] ||
      kv_page_seq_X.element_count() != kv_pages_X.element_count() || positions_T.element_count() != qd[0])
    return false;
  a.T = qd[0], a.N = qd[1], a.H = qd[2];
  const int64_t L = cd[0];
  a.P = cd[1], a.p = cd[2], a.K = cd[3], a.G = a.N / a.K;
  a.X = kv_pages_X.element_count();
  const int64_t lay = clamp_layer(layer.typed_data()[0], L);
  a.q = q_TNH.typed_data();
  a.kc = k_LPpKH.typed_data() + lay * a.P * a.p * a.K * a.H;
  a.vc = v_LPpKH.typed_data() + lay * a.P * a.p * a.K * a.H;
  a.pages = kv_pages_X.typed_data();
  a.page_seq = kv_page_seq_X.typed_data();
  a.pos = positions_T.typed_data();
  a.out = out_TNH->typed_data();
  std::memset(a.out, 0, sizeof(float) * a.T * a.N * a.H);
  return true;
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q_TNH, ffi::Buffer<ffi::F32> k_LPpKH,
                           ffi::Buffer<ffi::F32> v_LPpKH, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> kv_pages_X, ffi::Buffer<ffi::S32> kv_page_seq_X,
                           ffi::Buffer<ffi::S32> positions_T, ffi::Buffer<ffi::S32> num_decode,
                           ffi::ResultBuffer<ffi::F32> out_TNH, int64_t sliding_window) {
  Paged a;
  if (!unpack(q_TNH, k_LPpKH, v_LPpKH, layer, kv_pages_X, kv_page_seq_X, positions_T, out_TNH, a))
    return ffi::Error::InvalidArgument("multilora decode attention: operand shapes disagree");
  const int64_t T = a.T, N = a.N, H = a.H, P = a.P, p = a.p, K = a.K, G = a.G, X = a.X;
  const float *q = a.q, *kc = a.kc, *vc = a.vc;
  const int32_t *pages = a.pages, *page_seq = a.page_seq, *pos = a.pos;
  float* out = a.out;
  const int64_t B = std::clamp<int64_t>(num_decode.typed_data()[0], 0, T);

  // Each decode row's run of pages (kv_page_seq_X ascends; other sequences' and padding pages
  // are skipped).
  std::vector<int64_t> start, count;
  page_runs(page_seq, X, B, start, count);
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

// ---- prefill -----------------------------------------------------------------------------------
//
// Every token t with seq_T[t] >= 0 attends to the keys of its sequence at positions <=
// positions_T[t] (and > positions_T[t] - sliding_window when a window is set), the sequence's
// pages being its run of kv_page_seq_X in kv_pages_X (key j in page kv_pages_X[start + j / p]).
// Tokens go in blocks of up to kQueryBlock consecutive tokens of one sequence; a block walks its
// keys in chunks of kKeyChunk, each chunk's K/V read once for all the block's tokens and heads,
// with an online softmax (running max, sum and output per token and head). Other rows are zeros.

constexpr int64_t kQueryBlock = 16;
constexpr int64_t kKeyChunk = 32;

struct QueryBlock {
  int64_t t0, n, start, keys;  // tokens [t0, t0 + n); the sequence's first page in X; its key slots
};

ffi::Error PrefillAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q_TNH, ffi::Buffer<ffi::F32> k_LPpKH,
                            ffi::Buffer<ffi::F32> v_LPpKH, ffi::Buffer<ffi::S32> layer,
                            ffi::Buffer<ffi::S32> kv_pages_X, ffi::Buffer<ffi::S32> kv_page_seq_X,
                            ffi::Buffer<ffi::S32> seq_T, ffi::Buffer<ffi::S32> positions_T,
                            ffi::ResultBuffer<ffi::F32> out_TNH, int64_t sliding_window) {
  Paged a;
  if (!unpack(q_TNH, k_LPpKH, v_LPpKH, layer, kv_pages_X, kv_page_seq_X, positions_T, out_TNH, a) ||
      seq_T.element_count() != a.T)
    return ffi::Error::InvalidArgument("multilora prefill attention: operand shapes disagree");
  const int64_t T = a.T, N = a.N, H = a.H, P = a.P, p = a.p, K = a.K, G = a.G;
  const float *q = a.q, *kc = a.kc, *vc = a.vc;
  const int32_t *pages = a.pages, *page_seq = a.page_seq, *pos = a.pos;
  const int32_t* seq = seq_T.typed_data();
  float* out = a.out;

  // Each sequence's run of pages (sequence ids below T + 1; others are padding).
  std::vector<int64_t> start, count;
  page_runs(page_seq, a.X, T + 1, start, count);
  std::vector<QueryBlock> items;
  for (int64_t t = 0; t < T;) {
    const int64_t s = seq[t];
    if (s < 0 || s > T || start[s] < 0 || pos[t] < 0) {
      ++t;
      continue;
    }
    int64_t n = 1;
    while (n < kQueryBlock && t + n < T && seq[t + n] == s && pos[t + n] >= 0) ++n;
    items.push_back(QueryBlock{t, n, start[s], count[s] * p});
    t += n;
  }
  const float scale = 1.f / std::sqrt(static_cast<float>(H));
  const int64_t row_stride = K * H;

  parallel_items(pool, items, [&](const QueryBlock& it) {
    // per token i of the block and query head h: running max m, sum l, output acc (H floats)
    thread_local std::vector<float> m, l, acc, s;
    m.assign(it.n * N, -INFINITY);
    l.assign(it.n * N, 0.f);
    acc.assign(it.n * N * H, 0.f);
    s.resize(kKeyChunk);
    int64_t lo_all = INT64_MAX, hi_all = 0;  // the block's keys [lo_all, hi_all)
    std::vector<int64_t> lo(it.n), hi(it.n);
    for (int64_t i = 0; i < it.n; ++i) {
      const int64_t ps = pos[it.t0 + i];
      hi[i] = std::min<int64_t>(ps + 1, it.keys);
      lo[i] = sliding_window > 0 ? std::max<int64_t>(0, ps - sliding_window + 1) : 0;
      lo_all = std::min(lo_all, lo[i]);
      hi_all = std::max(hi_all, hi[i]);
    }
    int64_t off[kKeyChunk];
    for (int64_t c0 = lo_all; c0 < hi_all; c0 += kKeyChunk) {
      const int64_t c1 = std::min(c0 + kKeyChunk, hi_all);
      for (int64_t j = c0; j < c1; ++j) {
        const int64_t page = std::clamp<int64_t>(pages[it.start + j / p], 0, P - 1);
        off[j - c0] = (page * p + j % p) * row_stride;
      }
      for (int64_t i = 0; i < it.n; ++i) {
        const int64_t a = std::max(c0, lo[i]), b = std::min(c1, hi[i]);
        if (a >= b) continue;
        const float* qi = q + (it.t0 + i) * N * H;
        for (int64_t h = 0; h < N; ++h) {
          const int64_t kvo = (h / G) * H;
          float mx = -INFINITY;
          for (int64_t j = a; j < b; ++j) {
            const float v = dot(qi + h * H, kc + off[j - c0] + kvo, H) * scale;
            s[j - a] = v;
            mx = std::max(mx, v);
          }
          const int64_t ih = i * N + h;
          const float m_new = std::max(m[ih], mx);
          const float alpha = exp1(m[ih] - m_new);  // exp(-inf) = 0 on the first chunk
          float* ac = acc.data() + ih * H;
          if (alpha != 1.f)
            for (int64_t d = 0; d < H; ++d) ac[d] *= alpha;
          const int64_t n = b - a;
          f8 sum8 = splat(0.f);
          int64_t j = 0;
          for (; j + kW <= n; j += kW) {
            const f8 e = exp8(load8(s.data() + j) - splat(m_new));
            store8(s.data() + j, e);
            sum8 += e;
          }
          float sum = hsum(sum8);
          for (; j < n; ++j) sum += (s[j] = exp1(s[j] - m_new));
          for (j = 0; j < n; ++j) axpy(ac, s[j], vc + off[a + j - c0] + kvo, H);
          l[ih] = l[ih] * alpha + sum;
          m[ih] = m_new;
        }
      }
    }
    for (int64_t i = 0; i < it.n; ++i)
      for (int64_t h = 0; h < N; ++h) {
        const int64_t ih = i * N + h;
        if (l[ih] <= 0.f) continue;
        const float inv = 1.f / l[ih];
        float* o = out + (it.t0 + i) * N * H + h * H;
        for (int64_t d = 0; d < H; ++d) o[d] = acc[ih * H + d] * inv;
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiloraPrefillAttention, PrefillAttention,
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
