// Attention for the CPU, reading the paged KV cache in place: decode rows and prefill chunks.
//
// XLA's CPU backend runs the decode step's attention (multilora/model/attention.py,
// decode_attention) as a gather that copies every page of the step out of the cache, for every
// layer, before two small batched products. These kernels walk each query's pages straight
// in the whole (L, P, p, K, H) cache at the layer given as an operand (so the scan over layers
// copies nothing), and stop at the query's own position: the work is the keys each query sees.
//
// For a query token t (a decode row b < num_decode, or a token of a prefill chunk), each kv head
// k and each of its G query heads g (query head k * G + g):
//   out[t, k*G + g] = sum_j softmax_j(q[t, k*G+g] . K[j, k] / sqrt(H)) V[j, k]
// over keys j <= positions_T[t] (and j > positions_T[t] - sliding_window when a window is set).
// Rows the kernel does not serve, and rows that see no key, are zeros. Both kernels run one
// routine (attend_block), so a token's output is the same bits in either (see there).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using multilora::clamp_layer;
using multilora::parallel_items;

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

// The lanes of eight vectors summed, vector j's into lane j, each by the same tree:
// ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)). With AVX, four horizontal adds and a swap of
// halves; elsewhere the tree written out (the same sums, so the same bits).
inline f8 sum_lanes8(const f8* v) {
#if defined(__AVX__)
  const __m256 t0 = _mm256_hadd_ps((__m256)v[0], (__m256)v[1]);  // [a01 a23 b01 b23 | a45 a67 b45 b67]
  const __m256 t1 = _mm256_hadd_ps((__m256)v[2], (__m256)v[3]);
  const __m256 t2 = _mm256_hadd_ps((__m256)v[4], (__m256)v[5]);
  const __m256 t3 = _mm256_hadd_ps((__m256)v[6], (__m256)v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // [a0123 b0123 c0123 d0123 | a4567 b4567 c4567 d4567]
  const __m256 u1 = _mm256_hadd_ps(t2, t3);  // the same for e, f, g, h
  return (f8)_mm256_permute2f128_ps(u0, u1, 0x20) + (f8)_mm256_permute2f128_ps(u0, u1, 0x31);
#else
  f8 r;
  for (int j = 0; j < kW; ++j)
    r[j] = ((v[j][0] + v[j][1]) + (v[j][2] + v[j][3])) + ((v[j][4] + v[j][5]) + (v[j][6] + v[j][7]));
  return r;
#endif
}

// q . k_j for eight keys (rows kp[0..8), H floats each): key j's products summed lane-wise in its
// own accumulator (8 floats at a time, d ascending), its lanes by sum_lanes8's tree, then the
// H % 8 tail in order. Eight independent accumulators: the products pipeline.
inline f8 dot8(const float* __restrict q, const float* const* kp, int64_t H) {
  f8 acc[kW];
  for (int j = 0; j < kW; ++j) acc[j] = splat(0.f);
  int64_t d = 0;
  for (; d + kW <= H; d += kW) {
    const f8 qv = load8(q + d);
#pragma GCC unroll 8
    for (int j = 0; j < kW; ++j) acc[j] += qv * load8(kp[j] + d);
  }
  f8 r = sum_lanes8(acc);
  for (; d < H; ++d)
    for (int j = 0; j < kW; ++j) r[j] += q[d] * kp[j][d];
  return r;
}

// acc[d0, d0 + 8R) += sum_j w[j] v_j[d0, d0 + 8R) over j < n in order, the R vectors of the sums
// held in registers across the keys.
template <int R>
inline void weighted_rows(float* __restrict acc, const float* w, const float* const* vp, int64_t n, int64_t d0) {
  f8 a[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) a[r] = load8(acc + d0 + r * kW);
  for (int64_t j = 0; j < n; ++j) {
    const f8 wj = splat(w[j]);
    const float* v = vp[j] + d0;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) a[r] += wj * load8(v + r * kW);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) store8(acc + d0 + r * kW, a[r]);
}

// acc_H += sum_j w[j] v_j over j < n, in order of j for every lane.
inline void weighted_sum(float* __restrict acc, const float* w, const float* const* vp, int64_t n, int64_t H) {
  int64_t d = 0;
  for (; d + 8 * kW <= H; d += 8 * kW) weighted_rows<8>(acc, w, vp, n, d);
  for (; d + 4 * kW <= H; d += 4 * kW) weighted_rows<4>(acc, w, vp, n, d);
  for (; d + kW <= H; d += kW) weighted_rows<1>(acc, w, vp, n, d);
  for (; d < H; ++d) {
    float a = acc[d];
    for (int64_t j = 0; j < n; ++j) a += w[j] * vp[j][d];
    acc[d] = a;
  }
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

// ---- one arithmetic for every query token -------------------------------------------------------
//
// A token t of sequence s attends to the keys of s at positions <= positions_T[t] (and >
// positions_T[t] - sliding_window when a window is set), the sequence's pages being its run of
// kv_page_seq_X in kv_pages_X (key j in page kv_pages_X[start + j / p]). Tokens go in blocks of up
// to kQueryBlock consecutive tokens of one sequence (a decode row is a block of one); a block walks
// its keys in chunks of kKeyChunk, each chunk's K/V read once for all the block's tokens and heads,
// with an online softmax (running max, sum and output per token and head). Within a chunk, a kv
// head's rows serve its G query heads one after the other (read from memory once, then from L1):
// scores eight keys at a time (dot8: eight independent sums, no horizontal add per key), the
// weighted values summed in registers across the chunk's keys (weighted_sum). The next chunk's
// rows are prefetched while this one is computed, a kv head's share at a time; a thread takes
// blocks in runs of consecutive ones, and a block's last chunk prefetches the next block's first
// (a decode row's first keys were otherwise read cold; 64 rows x 80 keys on an AVX2 Zen 3:
// 0.85-0.9x the time, benchmarks/log/42). On an AVX2 host (2 cores of a Zen 3) a 64-row
// decode step's attention over ~80 keys a row went 24 -> 15 ms for SmolLM2's 30 layers: the
// arithmetic had cost 17 ms of it (one accumulator per dot, a scalar horizontal sum per key,
// the output re-read per key), now 8.
//
// The chunks lie on a fixed grid of key positions (multiples of kKeyChunk), so a token's sums
// are taken in the same order whatever block it is in, and a decode row (the decode kernel) gets
// the same bits as the same token inside a prefill chunk (the prefill kernel): a position's
// output does not depend on how many tokens of its sequence share its step. Speculative decoding
// verifies drafted tokens as a chunk and must reproduce the decode steps' tokens; with bfloat16
// projections, a last-bit difference here (the decode kernel once took a softmax over all keys,
// the prefill kernel an online one) flipped roundings to bfloat16 and, tens of layers on, a greedy
// token (multilora/engine/speculative.py).

constexpr int64_t kQueryBlock = 16;
constexpr int64_t kKeyChunk = 32;

struct QueryBlock {
  int64_t t0, n, start, keys;  // tokens [t0, t0 + n); the sequence's first page in X; its key slots
};

// The cache rows of keys [j0, j1) of a block's sequence (every kv head's K and V) asked into the
// cache ahead of use: a decode row's next chunk arrives while this one is computed (a row's pages
// lie anywhere in the cache, where the hardware's own prefetch does not look).
inline void prefetch_keys(const Paged& a, const QueryBlock& it, int64_t j0, int64_t j1) {
  const int64_t row = a.K * a.H, bytes = row * static_cast<int64_t>(sizeof(float));
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t page = std::clamp<int64_t>(a.pages[it.start + j / a.p], 0, a.P - 1);
    const char* kr = reinterpret_cast<const char*>(a.kc + (page * a.p + j % a.p) * row);
    const char* vr = reinterpret_cast<const char*>(a.vc + (page * a.p + j % a.p) * row);
    for (int64_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(kr + b);
      __builtin_prefetch(vr + b);
    }
  }
}

// The keys [lo, hi) a block's tokens see between them.
// The keys [lo, hi) token i of a block sees: up to its own position, within the window if any.
inline std::pair<int64_t, int64_t> token_keys(const Paged& a, const QueryBlock& it, int64_t i, int64_t sliding_window) {
  const int64_t ps = a.pos[it.t0 + i];
  return {sliding_window > 0 ? std::max<int64_t>(0, ps - sliding_window + 1) : 0, std::min<int64_t>(ps + 1, it.keys)};
}

inline std::pair<int64_t, int64_t> block_keys(const Paged& a, const QueryBlock& it, int64_t sliding_window) {
  int64_t lo = INT64_MAX, hi = 0;
  for (int64_t i = 0; i < it.n; ++i) {
    const auto [lo_i, hi_i] = token_keys(a, it, i, sliding_window);
    lo = std::min(lo, lo_i), hi = std::max(hi, hi_i);
  }
  return {lo, hi};
}

// next: the block this thread takes after this one (or null): its first chunk is prefetched
// while this block's last chunk is computed, so that a decode row (two or three chunks at a
// typical context) does not start on keys still in memory.
void attend_block(const Paged& a, const QueryBlock& it, int64_t sliding_window, const QueryBlock* next) {
  const int64_t N = a.N, H = a.H, P = a.P, p = a.p, G = a.G, row_stride = a.K * a.H;
  const float *q = a.q, *kc = a.kc, *vc = a.vc;
  const int32_t* pages = a.pages;
  const float scale = 1.f / std::sqrt(static_cast<float>(H));
  // per token i of the block and query head h: running max m, sum l, output acc (H floats)
  thread_local std::vector<float> m, l, acc, s, zeros;
  thread_local std::vector<int64_t> lo, hi;
  m.assign(it.n * N, -INFINITY);
  l.assign(it.n * N, 0.f);
  acc.assign(it.n * N * H, 0.f);
  s.resize(kKeyChunk);
  zeros.assign(H, 0.f);
  lo.resize(it.n);
  hi.resize(it.n);
  for (int64_t i = 0; i < it.n; ++i) std::tie(lo[i], hi[i]) = token_keys(a, it, i, sliding_window);
  const auto [lo_all, hi_all] = block_keys(a, it, sliding_window);  // the block's keys
  int64_t off[kKeyChunk];
  for (int64_t c0 = lo_all / kKeyChunk * kKeyChunk; c0 < hi_all; c0 += kKeyChunk) {
    const int64_t c1 = std::min(c0 + kKeyChunk, hi_all), f0 = std::max(c0, lo_all);
    for (int64_t j = f0; j < c1; ++j) {
      const int64_t page = std::clamp<int64_t>(pages[it.start + j / p], 0, P - 1);
      off[j - c0] = (page * p + j % p) * row_stride;
    }
    // what to fetch while this chunk is computed, a kv head's share at a time (a burst of the
    // whole chunk's lines stalls the core, then leaves the memory idle while it computes)
    const QueryBlock* ahead = nullptr;
    int64_t a0 = 0, a1 = 0;
    if (c1 < hi_all) {
      ahead = &it, a0 = c1, a1 = std::min(c1 + kKeyChunk, hi_all);
    } else if (next != nullptr) {
      const auto [nlo, nhi] = block_keys(a, *next, sliding_window);
      ahead = next, a0 = nlo, a1 = std::min(nlo / kKeyChunk * kKeyChunk + kKeyChunk, nhi);
    }
    for (int64_t i = 0; i < it.n; ++i) {
      const int64_t lo_i = std::max(c0, lo[i]), hi_i = std::min(c1, hi[i]);
      if (lo_i >= hi_i) continue;
      const int64_t n = hi_i - lo_i, n8 = (n + kW - 1) / kW * kW;
      const float* qi = q + (it.t0 + i) * N * H;
      for (int64_t k = 0; k < a.K; ++k) {
        if (ahead != nullptr && i == 0)
          prefetch_keys(a, *ahead, a0 + (a1 - a0) * k / a.K, a0 + (a1 - a0) * (k + 1) / a.K);
        // the chunk's key and value rows of kv head k (keys past n: a row of zeros, scores unused)
        const float* kp[kKeyChunk];
        const float* vp[kKeyChunk];
        for (int64_t j = 0; j < n8; ++j) {
          kp[j] = j < n ? kc + off[lo_i + j - c0] + k * H : zeros.data();
          vp[j] = j < n ? vc + off[lo_i + j - c0] + k * H : zeros.data();
        }
        for (int64_t h = k * G; h < (k + 1) * G; ++h) {  // the kv head's query heads: its rows hot in L1
          float mx = -INFINITY;
          for (int64_t j = 0; j < n8; j += kW) {
            const f8 d8 = dot8(qi + h * H, kp + j, H) * splat(scale);
            store8(s.data() + j, d8);
          }
          for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
          const int64_t ih = i * N + h;
          const float m_new = std::max(m[ih], mx);
          const float alpha = exp1(m[ih] - m_new);  // exp(-inf) = 0 on the first chunk
          float* ac = acc.data() + ih * H;
          if (alpha != 1.f)
            for (int64_t d = 0; d < H; ++d) ac[d] *= alpha;
          f8 sum8 = splat(0.f);
          int64_t j = 0;
          for (; j + kW <= n; j += kW) {
            const f8 e = exp8(load8(s.data() + j) - splat(m_new));
            store8(s.data() + j, e);
            sum8 += e;
          }
          float sum = hsum(sum8);
          for (; j < n; ++j) sum += (s[j] = exp1(s[j] - m_new));
          weighted_sum(ac, s.data(), vp, n, H);
          l[ih] = l[ih] * alpha + sum;
          m[ih] = m_new;
        }
      }
    }
  }
  for (int64_t i = 0; i < it.n; ++i)
    for (int64_t h = 0; h < N; ++h) {
      const int64_t ih = i * N + h;
      if (l[ih] <= 0.f) continue;
      const float inv = 1.f / l[ih];
      float* o = a.out + (it.t0 + i) * N * H + h * H;
      for (int64_t d = 0; d < H; ++d) o[d] = acc[ih * H + d] * inv;
    }
}

// The blocks in runs of consecutive ones, a run a work item: a thread takes a run's blocks in
// order and prefetches each next block's first keys (attend_block's `next`). Four runs a thread
// at least, for balance.
void attend_runs(ffi::ThreadPool& pool, const Paged& a, const std::vector<QueryBlock>& blocks,
                 int64_t sliding_window) {
  const int64_t n = static_cast<int64_t>(blocks.size());
  const int64_t workers = std::max<int64_t>(1, pool.num_threads() + 1);
  const int64_t per = std::max<int64_t>(1, n / (4 * workers));
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t b = 0; b < n; b += per) runs.push_back({b, std::min(n, b + per)});
  parallel_items(pool, runs, [&](const std::pair<int64_t, int64_t>& r) {
    for (int64_t b = r.first; b < r.second; ++b)
      attend_block(a, blocks[b], sliding_window, b + 1 < r.second ? &blocks[b + 1] : nullptr);
  });
}

// ---- decode: rows b < num_decode, one token each, a block of one ------------------------------

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q_TNH, ffi::Buffer<ffi::F32> k_LPpKH,
                           ffi::Buffer<ffi::F32> v_LPpKH, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> kv_pages_X, ffi::Buffer<ffi::S32> kv_page_seq_X,
                           ffi::Buffer<ffi::S32> positions_T, ffi::Buffer<ffi::S32> num_decode,
                           ffi::ResultBuffer<ffi::F32> out_TNH, int64_t sliding_window) {
  Paged a;
  if (!unpack(q_TNH, k_LPpKH, v_LPpKH, layer, kv_pages_X, kv_page_seq_X, positions_T, out_TNH, a))
    return ffi::Error::InvalidArgument("multilora decode attention: operand shapes disagree");
  const int64_t B = std::clamp<int64_t>(num_decode.typed_data()[0], 0, a.T);
  // Each decode row's run of pages (kv_page_seq_X ascends; other sequences' and padding pages
  // are skipped).
  std::vector<int64_t> start, count;
  page_runs(a.page_seq, a.X, B, start, count);
  std::vector<QueryBlock> items;
  items.reserve(B);
  for (int64_t b = 0; b < B; ++b)
    if (start[b] >= 0 && a.pos[b] >= 0) items.push_back(QueryBlock{b, 1, start[b], count[b] * a.p});
  attend_runs(pool, a, items, sliding_window);
  return ffi::Error::Success();
}

// ---- prefill: every token of a chunk (seq_T >= 0), other rows zeros ---------------------------

ffi::Error PrefillAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q_TNH, ffi::Buffer<ffi::F32> k_LPpKH,
                            ffi::Buffer<ffi::F32> v_LPpKH, ffi::Buffer<ffi::S32> layer,
                            ffi::Buffer<ffi::S32> kv_pages_X, ffi::Buffer<ffi::S32> kv_page_seq_X,
                            ffi::Buffer<ffi::S32> seq_T, ffi::Buffer<ffi::S32> positions_T,
                            ffi::ResultBuffer<ffi::F32> out_TNH, int64_t sliding_window) {
  Paged a;
  if (!unpack(q_TNH, k_LPpKH, v_LPpKH, layer, kv_pages_X, kv_page_seq_X, positions_T, out_TNH, a) ||
      seq_T.element_count() != a.T)
    return ffi::Error::InvalidArgument("multilora prefill attention: operand shapes disagree");
  const int64_t T = a.T;
  const int32_t* seq = seq_T.typed_data();
  // Each sequence's run of pages (sequence ids below T + 1; others are padding).
  std::vector<int64_t> start, count;
  page_runs(a.page_seq, a.X, T + 1, start, count);
  std::vector<QueryBlock> items;
  for (int64_t t = 0; t < T;) {
    const int64_t s = seq[t];
    if (s < 0 || s > T || start[s] < 0 || a.pos[t] < 0) {
      ++t;
      continue;
    }
    int64_t n = 1;
    while (n < kQueryBlock && t + n < T && seq[t + n] == s && a.pos[t + n] >= 0) ++n;
    items.push_back(QueryBlock{t, n, start[s], count[s] * a.p});
    t += n;
  }
  attend_runs(pool, a, items, sliding_window);
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
