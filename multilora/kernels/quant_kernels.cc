// The base model's projections with 8- or 4-bit weights in groups (GGUF's Q8_0 and Q4_0 arithmetic), reading one
// layer of the stacked, pre-packed weights in place, with AVX2 + FMA (every x86 CPU from Intel
// Haswell and AMD Zen 1 on, and so every AVX512 one too).
//
// y_TN = x_TK @ W[layer],  W[k, n] = q[k, n] * s[k / 32, n]  (q int8, s float32: one scale per
// group of 32 rows of K per column, as GGUF's Q8_0 blocks of 32 with one scale each). x stays
// float32; each group's int8 values are widened to float32 in registers and multiplied by their
// scale (an exact dequantization, the float32 product q * s rounded once, as a plain reference
// computes it), the products summed in float32 by FMA. A decode step reads a quarter of float32's
// weight bytes (plus a scale per 32 weights), half of bfloat16's: at a few rows a step is bound
// by those bytes.
//
// Packed once, at load time (multilora.kernels.pack_q8), per column block of 16:
//   q_LJKC[l, j, k, c] = q(W[l])[k, 16 j + c]       a block's K rows one contiguous stream of
//                                                   16-byte rows (zero past K or N)
//   s_LJGC[l, j, g, c] = s(W[l])[g, 16 j + c]        its scales, a 64-byte row a group
// with J = ceil(N / 16), K padded to Kp = 32 ceil(K / 32) and G = Kp / 32. At 4 bits (Q4_0:
// W[k, n] = (v[k, n] - 8) * s[k / 32, n], v in 0-15) a row is 8 bytes, byte c holding column c in
// its low nibble and column c + 8 in its high one: an eighth of float32's bytes.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX2__) && defined(__FMA__)
#define MULTILORA_Q8_AVX2 1
#include <immintrin.h>
#endif

namespace {

using multilora::clamp_layer;
using multilora::parallel_items;

struct Run {
  int64_t j0, j1;  // 16-column blocks [j0, j1)
};

#ifdef MULTILORA_Q8_AVX2

constexpr int kRows = 3;            // rows per tile: 3 x 2 x 2 accumulators, 2 weight and 2 scale vectors
constexpr int64_t kPassRows = 256;  // K rows per pass: a 4-block panel's 16 KiB of int8, 8 groups

// The two weight formats, each one K row of a 16-column block widened to float32 in registers
// (w0: columns 0-7, w1: 8-15) and scaled by its group's scales.
struct Q8 {  // int8 values: 16 bytes a row
  static constexpr int64_t kRowBytes = 16;
  static inline void row(const uint8_t* p, __m256 s0, __m256 s1, __m256 m0, __m256 m1, __m256& w0, __m256& w1) {
    const __m128i r = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(r)), s0);
    w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(r, 8))), s1);
  }
};
struct Q4 {  // 4-bit values v in 0-15 standing for v - 8: 8 bytes a row, byte c holding column c
             // (low nibble) and column c + 8 (high); (v - 8) s as one FMA, v s - 8 s (exact: -8 s is)
  static constexpr int64_t kRowBytes = 8;
  static inline void row(const uint8_t* p, __m256 s0, __m256 s1, __m256 m0, __m256 m1, __m256& w0, __m256& w1) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))), s0, m0);
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), s1, m1);
  }
};

// y[m, 0:cols] (+)= x[m, k0:k1] @ W's rows [k0, k1) of one 16-column block (k0, k1 multiples of
// 32), for M rows: each group's 16 x 32 values widened and scaled as they stream by. The even and
// the odd K rows have sums of their own (added at the end): with one set a decode row's two
// chains of FMAs were bound by an FMA's latency; every M sums in this one order, so a row's bits
// do not depend on how many rows share its tile.
template <class F, int M>
inline void q_tile(const float* x, int64_t ldx, const uint8_t* q, const float* s, int64_t k0, int64_t k1,
                   float* y, int64_t ldy, int64_t cols, bool add) {
  constexpr int U = 2;  // sets of sums: K rows taken U at a time
  __m256 acc[U][M][2];
  alignas(32) float tmp[16];
  for (int m = 0; m < M; ++m) {
    for (int u = 1; u < U; ++u) acc[u][m][0] = acc[u][m][1] = _mm256_setzero_ps();
    if (!add) {
      acc[0][m][0] = acc[0][m][1] = _mm256_setzero_ps();
    } else if (cols == 16) {
      acc[0][m][0] = _mm256_loadu_ps(y + m * ldy);
      acc[0][m][1] = _mm256_loadu_ps(y + m * ldy + 8);
    } else {
      std::memset(tmp, 0, sizeof tmp);
      std::memcpy(tmp, y + m * ldy, cols * 4);
      acc[0][m][0] = _mm256_load_ps(tmp);
      acc[0][m][1] = _mm256_load_ps(tmp + 8);
    }
  }
  const __m256 minus8 = _mm256_set1_ps(-8.f);
  for (int64_t g = k0 / 32; g < k1 / 32; ++g) {
    const __m256 s0 = _mm256_loadu_ps(s + g * 16), s1 = _mm256_loadu_ps(s + g * 16 + 8);
    const __m256 m0 = _mm256_mul_ps(s0, minus8), m1 = _mm256_mul_ps(s1, minus8);
    for (int64_t k = 32 * g; k < 32 * g + 32; k += U) {
      for (int u = 0; u < U; ++u) {
        __m256 w0, w1;
        F::row(q + (k + u) * F::kRowBytes, s0, s1, m0, m1, w0, w1);
        for (int m = 0; m < M; ++m) {
          const __m256 xv = _mm256_broadcast_ss(x + m * ldx + k + u);
          acc[u][m][0] = _mm256_fmadd_ps(xv, w0, acc[u][m][0]);
          acc[u][m][1] = _mm256_fmadd_ps(xv, w1, acc[u][m][1]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int u = 1; u < U; ++u) {
      acc[0][m][0] = _mm256_add_ps(acc[0][m][0], acc[u][m][0]);
      acc[0][m][1] = _mm256_add_ps(acc[0][m][1], acc[u][m][1]);
    }
    if (cols == 16) {
      _mm256_storeu_ps(y + m * ldy, acc[0][m][0]);
      _mm256_storeu_ps(y + m * ldy + 8, acc[0][m][1]);
    } else {
      _mm256_store_ps(tmp, acc[0][m][0]);
      _mm256_store_ps(tmp + 8, acc[0][m][1]);
      std::memcpy(y + m * ldy, tmp, cols * 4);
    }
  }
}

template <class F>
inline void q_rows(int64_t rows, const float* x, int64_t ldx, const uint8_t* q, const float* s, int64_t k0,
                   int64_t k1, float* y, int64_t ldy, int64_t cols, bool add) {
  switch (rows) {
    case 1: return q_tile<F, 1>(x, ldx, q, s, k0, k1, y, ldy, cols, add);
    case 2: return q_tile<F, 2>(x, ldx, q, s, k0, k1, y, ldy, cols, add);
    default: return q_tile<F, kRows>(x, ldx, q, s, k0, k1, y, ldy, cols, add);
  }
}

// Column blocks [j0, j1), all T rows of x (float32, ldx = Kp): panels of up to 4 blocks, K in
// passes of kPassRows (a pass adds to the sums the previous one stored), the panel's pass of W
// kept in L1/L2 while the rows go by kRows at a time; the next pass's weight rows are prefetched
// into L2 a share at every tile (decode: one tile, W streams from memory).
template <class F>
void q_blocks(int64_t j0, int64_t j1, const float* x, int64_t ldx, const uint8_t* q, const float* s, int64_t T,
              int64_t Kp, int64_t N, float* y) {
  const int64_t qstride = Kp * F::kRowBytes, sstride = Kp / 2, tiles = (T + kRows - 1) / kRows;
  for (int64_t jp = j0; jp < j1; jp += 4) {
    const int64_t nb = std::min<int64_t>(4, j1 - jp);
    for (int64_t k0 = 0; k0 < Kp; k0 += kPassRows) {
      const int64_t k1 = std::min(Kp, k0 + kPassRows);
      const bool last = k1 >= Kp;  // the next pass: blocks [nj, nj + nnb), rows [nk0, nk1)
      const int64_t nj = last ? jp + 4 : jp, nk0 = last ? 0 : k1, nk1 = std::min(Kp, nk0 + kPassRows);
      const int64_t nnb = nj < j1 ? std::min<int64_t>(4, j1 - nj) : 0, per_block = (nk1 - nk0) * F::kRowBytes / 64;  // 64-byte lines
      const int64_t lines = nnb * per_block, calls = tiles * nb, each = (lines + calls - 1) / calls;
      int64_t left = lines, fb = 0, fl = 0;
      for (int64_t m = 0; m < T; m += kRows)
        for (int64_t b = 0; b < nb; ++b) {
          for (int64_t f = 0; f < each && left > 0; ++f, --left) {
            _mm_prefetch(reinterpret_cast<const char*>(q + (nj + fb) * qstride + nk0 * F::kRowBytes + fl * 64), _MM_HINT_T1);
            if (++fl == per_block) fl = 0, ++fb;
          }
          const int64_t col = 16 * (jp + b), cols = std::min<int64_t>(16, N - col);
          if (cols <= 0) break;
          q_rows<F>(std::min<int64_t>(kRows, T - m), x + m * ldx, ldx, q + (jp + b) * qstride,
                    s + (jp + b) * sstride, k0, k1, y + m * N + col, N, cols, k0 > 0);
        }
    }
  }
}

#endif  // MULTILORA_Q8_AVX2

// Contiguous runs of column blocks, one per thread (the pool's and this one, at most one per
// core): each streams its part of W in order.
std::vector<Run> column_runs(ffi::ThreadPool& pool, int64_t J) {
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>({J, cores, pool.num_threads() + 1}));
  std::vector<Run> runs;
  for (int64_t p = 0; p < parts; ++p) runs.push_back({J * p / parts, J * (p + 1) / parts});
  return runs;
}

// bits: 8 (q: int8, 16 bytes a K row of a block) or 4 (q: uint8 pairs of 4-bit values, 8 bytes a
// row). rows: x's rows from this one on are the step's padding: not multiplied, y's rows there
// zeros (a row's sums never depend on other rows: the live rows' bits are the same either way).
ffi::Error GemmQuant(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x_TK, ffi::AnyBuffer q_LJKB,
                     ffi::Buffer<ffi::F32> s_LJGC, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows,
                     ffi::ResultBuffer<ffi::F32> y_TN, int64_t bits) {
  auto xd = x_TK.dimensions();
  auto qd = q_LJKB.dimensions();
  auto sd = s_LJGC.dimensions();
  auto yd = y_TN->dimensions();
  const int64_t row_bytes = bits == 8 ? 16 : 8;
  if ((bits != 8 && bits != 4) || ffi::ByteWidth(q_LJKB.element_type()) != 1)
    return ffi::Error::InvalidArgument("multilora gemm quant: bits must be 8 or 4, q one byte an element");
  if (xd.size() != 2 || qd.size() != 4 || sd.size() != 4 || yd.size() != 2 || yd[0] != xd[0] ||
      qd[3] != row_bytes || qd[2] % 32 != 0 || qd[2] < xd[1] || qd[1] * 16 < yd[1] || sd[0] != qd[0] ||
      sd[1] != qd[1] || sd[2] * 32 != qd[2] || sd[3] != 16 || rows.element_count() != 1)
    return ffi::Error::InvalidArgument("multilora gemm quant: operand shapes disagree");
#ifdef MULTILORA_Q8_AVX2
  const int64_t T = std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]);
  const int64_t K = xd[1], N = yd[1], L = qd[0], J = qd[1], Kp = qd[2];
  const int64_t l = clamp_layer(layer.typed_data()[0], L);
  const uint8_t* q = static_cast<const uint8_t*>(q_LJKB.untyped_data()) + l * J * Kp * row_bytes;
  const float* s = s_LJGC.typed_data() + l * J * (Kp / 32) * 16;
  float* y = y_TN->typed_data();
  if (T < xd[0]) std::memset(y + T * N, 0, sizeof(float) * (xd[0] - T) * N);
  if (T == 0) return ffi::Error::Success();
  // x read in place where K is whole groups; else a copy padded with zero columns to Kp
  std::vector<float> padded(K < Kp ? T * Kp : 0, 0.f);
  for (int64_t t = 0; K < Kp && t < T; ++t) std::memcpy(padded.data() + t * Kp, x_TK.typed_data() + t * K, K * 4);
  const float* x = K < Kp ? padded.data() : x_TK.typed_data();
  const std::vector<Run> runs = column_runs(pool, J);
  if (bits == 8)
    parallel_items(pool, runs, [&](const Run& r) { q_blocks<Q8>(r.j0, r.j1, x, Kp, q, s, T, Kp, N, y); });
  else
    parallel_items(pool, runs, [&](const Run& r) { q_blocks<Q4>(r.j0, r.j1, x, Kp, q, s, T, Kp, N, y); });
  return ffi::Error::Success();
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "multilora gemm quant: built without AVX2 and FMA");
#endif
}

}  // namespace

// Whether gemm_quant runs on this build and CPU (1) or not (0).
extern "C" int MultiloraGemmQuantAvailable() {
#ifdef MULTILORA_Q8_AVX2
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiloraGemmQuant, GemmQuant,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits"));
