// The base model's projections in bfloat16, reading one layer of the stacked, pre-packed weights
// in place: on Intel AMX where the CPU has it, else with AVX512-BF16 dot products (AMD Zen 4 and
// later, Intel Cooper Lake), else with AVX2 + FMA (AMD Zen 1-3, Intel Haswell on).
//
// y_TN = x_TK @ W[layer]  (AMX and AVX512-BF16: x float32, rounded to bfloat16 to nearest even; W
// bfloat16; the products accumulated in float32: the same numbers as XLA's bf16 x bf16 -> f32
// dot, summed in another order. AVX2: x stays float32, W's bfloat16 values are widened to float32
// in registers (exactly) and the products summed in float32 by FMA: the float32 product with
// bf16-rounded weights, half the bytes of float32 weights read).
//
// XLA's CPU backend slices each layer's weights out of the (L, K, N) stack by copying them
// before every GEMM of the layer scan, and its GEMMs use float32 FMAs at best. This kernel takes
// the whole stack and the layer index as operands (the scan copies nothing) and multiplies pairs
// of bfloat16 products per lane: with the AMX tile unit (TDPBF16PS: a 16 x 16 f32 tile += a
// 16 x 32 bf16 tile times a 32 x 16 one, per instruction), or with VDPBF16PS (16 f32 lanes +=
// two bf16 products each, per instruction).
//
// The weights are packed once, at load time (multilora.kernels.pack_bf16), into the tiles' own
// layout, so each tile of B is one contiguous KiB:
//   w_LJIRC[l, j, i, r, 2 c + e] = W[l][32 i + 2 r + e, 16 j + c]   (zero past K or N)
// with J = ceil(N / 32) * 2 column blocks of 16 and I = ceil(K / 32) row blocks of 32.
// The same layout is VDPBF16PS's: for a column block j, pair p = 16 i + r of K rows is one
// 64-byte vector (16 columns x 2 rows), the pairs of a block one contiguous stream.
//
// The same layout serves AVX2: a pair's 64 bytes are 16 32-bit words, word c holding column c's
// rows 2p (low half) and 2p + 1 (high half), so a word shifted left by 16 is row 2p's value as a
// float32 and the word masked to its high half is row 2p + 1's: two integer instructions widen 8
// values, no shuffles.
//
// Built with what the compiler targets (-march=native): AMX-BF16, AVX512-BF16, AVX2 + FMA, each
// where the CPU has it; where none runs the handler reports that it is unavailable and
// multilora.kernels.bf16_gemm_isa() is "".

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define MULTILORA_AVX512BF16 1
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define MULTILORA_AVX2 1
#include <immintrin.h>
#endif

#if defined(MULTILORA_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define MULTILORA_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using multilora::clamp_layer;
using multilora::parallel_items;

struct Block {
  int64_t j0, j1;  // 16-column blocks [j0, j1), an even run
};

#ifdef MULTILORA_AVX512BF16

// Rounds x_TK to bfloat16 (nearest even), T padded to Mp rows and K to Kp columns with zeros.
void to_bf16(const float* x, int64_t T, int64_t K, int64_t Mp, int64_t Kp, uint16_t* a) {
  std::memset(a, 0, sizeof(uint16_t) * Mp * Kp);
  for (int64_t t = 0; t < T; ++t) {
    const float* src = x + t * K;
    uint16_t* dst = a + t * Kp;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16), _mm512_loadu_ps(src + k));
      _mm512_storeu_si512(dst + k, (__m512i)v);
    }
    for (; k < K; ++k) {  // the same rounding, one at a time
      uint32_t bits;
      std::memcpy(&bits, src + k, 4);
      dst[k] = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
    }
  }
}

// What a row tile prefetches of the next panel's B (into L2, while it computes): lines
// [first, first + count) of the panel's NB streams of `pairs` 64-byte lines each.
struct Ahead {
  const uint16_t* w = nullptr;  // the next panel's first block; nullptr: nothing to fetch
  int64_t first = 0, count = 0;
};

// A panel of NB column blocks (16 columns each) for M rows, all of K: M x NB accumulators
// (M x NB <= 24 registers, 4 more for the B vectors), one VDPBF16PS per (row, block) per pair of K
// rows, x's pair broadcast from memory. ldk2: the pairs in a row of a (Kp / 2).
template <int M, int NB>
inline void dp_tile(const uint32_t* a, int64_t ldk2, const uint16_t* w, int64_t jstride, int64_t pairs,
                    float* y, int64_t ldy, int64_t cols, const Ahead& ahead) {
  __m512 acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
  // The next panel streams from memory while this one computes: `per` lines an iteration.
  int64_t left = ahead.w ? ahead.count : 0, stream = ahead.first / pairs, line = ahead.first % pairs;
  const int64_t per = (left + pairs - 1) / pairs;
  for (int64_t p = 0; p < pairs; ++p) {
    for (int64_t f = 0; f < per && left > 0; ++f, --left) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead.w + stream * jstride + line * 32), _MM_HINT_T1);
      if (++line == pairs) line = 0, ++stream;
    }
    __m512bh b[NB];
    for (int n = 0; n < NB; ++n) b[n] = (__m512bh)_mm512_loadu_si512(w + n * jstride + p * 32);
    for (int m = 0; m < M; ++m) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[m * ldk2 + p]));
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], av, b[n]);
    }
  }
  for (int n = 0; n < NB; ++n) {
    const int64_t c = std::min<int64_t>(16, cols - 16 * n);
    if (c <= 0) break;
    const __mmask16 mask = c >= 16 ? __mmask16(0xffff) : __mmask16((1u << c) - 1);
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * ldy + 16 * n, mask, acc[m][n]);
  }
}

constexpr int kRows = 6;  // rows per tile: 6 x 4 accumulators

template <int NB>
void dp_panel_rows(int64_t rows, const uint32_t* a, int64_t ldk2, const uint16_t* w, int64_t jstride,
                   int64_t pairs, float* y, int64_t ldy, int64_t cols, const Ahead& ahead) {
  switch (rows) {
    case 1: return dp_tile<1, NB>(a, ldk2, w, jstride, pairs, y, ldy, cols, ahead);
    case 2: return dp_tile<2, NB>(a, ldk2, w, jstride, pairs, y, ldy, cols, ahead);
    case 3: return dp_tile<3, NB>(a, ldk2, w, jstride, pairs, y, ldy, cols, ahead);
    case 4: return dp_tile<4, NB>(a, ldk2, w, jstride, pairs, y, ldy, cols, ahead);
    case 5: return dp_tile<5, NB>(a, ldk2, w, jstride, pairs, y, ldy, cols, ahead);
    default: return dp_tile<kRows, NB>(a, ldk2, w, jstride, pairs, y, ldy, cols, ahead);
  }
}

inline int64_t panel_blocks(int64_t j, int64_t j1) { return j + 4 <= j1 ? 4 : 2; }

// Column blocks [j0, j1) (an even run), all T rows: panels of 4 blocks (2 at the end); a panel's
// B (Kp x 64 columns, bf16) stays in L2 while its rows go by 6 at a time, and its row tiles
// share the prefetch of the next panel's B (decode: few rows per panel, W streams from memory).
void dp_blocks(int64_t j0, int64_t j1, const uint16_t* a, const uint16_t* w, int64_t T, int64_t Kp,
               int64_t I, int64_t N, float* y) {
  const int64_t jstride = I * 512, pairs = Kp / 2, tiles = (T + kRows - 1) / kRows;
  const uint32_t* a32 = reinterpret_cast<const uint32_t*>(a);
  for (int64_t j = j0; j < j1;) {
    const int64_t nb = panel_blocks(j, j1);
    const int64_t col = 16 * j, cols = std::min<int64_t>(16 * nb, N - col);
    const uint16_t* wj = w + j * jstride;
    const int64_t next = j + nb, lines = next < j1 ? panel_blocks(next, j1) * pairs : 0;
    for (int64_t m = 0, tile = 0; m < T && cols > 0; m += kRows, ++tile) {
      const int64_t rows = std::min<int64_t>(kRows, T - m);
      const int64_t first = lines * tile / tiles, count = lines * (tile + 1) / tiles - first;
      const Ahead ahead{lines ? w + next * jstride : nullptr, first, count};
      if (nb == 4)
        dp_panel_rows<4>(rows, a32 + m * pairs, pairs, wj, jstride, pairs, y + m * N + col, N, cols, ahead);
      else
        dp_panel_rows<2>(rows, a32 + m * pairs, pairs, wj, jstride, pairs, y + m * N + col, N, cols, ahead);
    }
    j = next;
  }
}

#endif  // MULTILORA_AVX512BF16

#ifdef MULTILORA_AVX2

constexpr int kFmaRows = 5;        // rows per tile: 5 x 2 accumulators (16 columns) of 16 ymm registers (6 spilled two)
constexpr int64_t kFmaPairs = 128;  // pairs of K rows per pass: a 4-block panel's 32 KiB, x's 5 KiB

// y[m, 0:cols] (+)= x[m, 2 p0 : 2 p1] @ W's rows [2 p0, 2 p1) of one 16-column block, for M rows:
// the block's pairs widened as they stream by (the even rows of the pair first, then the odd
// ones, so that two weight vectors are live beside the 10 accumulators), x broadcast from memory.
template <int M>
inline void fma_tile(const float* x, int64_t ldx, const uint16_t* w, int64_t p0, int64_t p1, float* y,
                     int64_t ldy, int64_t cols, bool add) {
  __m256 acc[M][2];
  alignas(32) float tmp[16];
  for (int m = 0; m < M; ++m) {
    if (!add) {
      acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    } else if (cols == 16) {
      acc[m][0] = _mm256_loadu_ps(y + m * ldy);
      acc[m][1] = _mm256_loadu_ps(y + m * ldy + 8);
    } else {
      std::memset(tmp, 0, sizeof tmp);
      std::memcpy(tmp, y + m * ldy, cols * 4);
      acc[m][0] = _mm256_load_ps(tmp);
      acc[m][1] = _mm256_load_ps(tmp + 8);
    }
  }
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t p = p0; p < p1; ++p) {
    const __m256i* wp = reinterpret_cast<const __m256i*>(w + p * 32);
    const float* xp = x + 2 * p;
    const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(wp), 16));
    const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(wp + 1), 16));
    for (int m = 0; m < M; ++m) {
      const __m256 xe = _mm256_broadcast_ss(xp + m * ldx);
      acc[m][0] = _mm256_fmadd_ps(xe, e0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xe, e1, acc[m][1]);
    }
    const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(wp), high));
    const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(wp + 1), high));
    for (int m = 0; m < M; ++m) {
      const __m256 xo = _mm256_broadcast_ss(xp + m * ldx + 1);
      acc[m][0] = _mm256_fmadd_ps(xo, o0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xo, o1, acc[m][1]);
    }
  }
  for (int m = 0; m < M; ++m) {
    if (cols == 16) {
      _mm256_storeu_ps(y + m * ldy, acc[m][0]);
      _mm256_storeu_ps(y + m * ldy + 8, acc[m][1]);
    } else {
      _mm256_store_ps(tmp, acc[m][0]);
      _mm256_store_ps(tmp + 8, acc[m][1]);
      std::memcpy(y + m * ldy, tmp, cols * 4);
    }
  }
}

inline void fma_rows(int64_t rows, const float* x, int64_t ldx, const uint16_t* w, int64_t p0, int64_t p1,
                     float* y, int64_t ldy, int64_t cols, bool add) {
  switch (rows) {
    case 1: return fma_tile<1>(x, ldx, w, p0, p1, y, ldy, cols, add);
    case 2: return fma_tile<2>(x, ldx, w, p0, p1, y, ldy, cols, add);
    case 3: return fma_tile<3>(x, ldx, w, p0, p1, y, ldy, cols, add);
    case 4: return fma_tile<4>(x, ldx, w, p0, p1, y, ldy, cols, add);
    default: return fma_tile<kFmaRows>(x, ldx, w, p0, p1, y, ldy, cols, add);
  }
}

// Column blocks [j0, j1), all T rows of x (float32, ldx >= 2 pairs): panels of up to 4 blocks,
// K in passes of kFmaPairs pairs (a pass adds to the sums the previous one stored), the panel's
// pass of W kept in L1/L2 while the rows go by 5 at a time. The next pass's W (the same panel's
// next pairs, or the next panel's first) is prefetched into L2 a share at every tile, so the
// first row tile of a pass does not wait on memory (one core of an AVX2 Zen 3, 64 rows, 30
// layers' weights streamed: 1.05-1.08x the GFLOP/s on SmolLM2's shapes; benchmarks/log/42).
void fma_blocks(int64_t j0, int64_t j1, const float* x, int64_t ldx, const uint16_t* w, int64_t T,
                int64_t pairs, int64_t I, int64_t N, float* y) {
  const int64_t jstride = I * 512, tiles = (T + kFmaRows - 1) / kFmaRows;
  for (int64_t jp = j0; jp < j1; jp += 4) {
    const int64_t nb = std::min<int64_t>(4, j1 - jp);
    for (int64_t p0 = 0; p0 < pairs; p0 += kFmaPairs) {
      const int64_t p1 = std::min(pairs, p0 + kFmaPairs);
      // the next pass: its blocks [nj, nj + nnb), pairs [np0, np1), a 64-byte line a pair
      const bool last = p1 >= pairs;
      const int64_t nj = last ? jp + 4 : jp, np0 = last ? 0 : p1, np1 = std::min(pairs, np0 + kFmaPairs);
      const int64_t nnb = nj < j1 ? std::min<int64_t>(4, j1 - nj) : 0, per_block = np1 - np0;
      const int64_t lines = nnb * per_block, calls = tiles * nb, each = (lines + calls - 1) / calls;
      int64_t left = lines, fb = 0, fp = 0;  // lines still to fetch; the next one's block and pair
      for (int64_t m = 0; m < T; m += kFmaRows)
        for (int64_t b = 0; b < nb; ++b) {
          for (int64_t f = 0; f < each && left > 0; ++f, --left) {
            _mm_prefetch(reinterpret_cast<const char*>(w + (nj + fb) * jstride + (np0 + fp) * 32), _MM_HINT_T1);
            if (++fp == per_block) fp = 0, ++fb;
          }
          const int64_t col = 16 * (jp + b), cols = std::min<int64_t>(16, N - col);
          if (cols <= 0) break;
          fma_rows(std::min<int64_t>(kFmaRows, T - m), x + m * ldx, ldx, w + (jp + b) * jstride, p0, p1,
                   y + m * N + col, N, cols, p0 > 0);
        }
    }
  }
}

#endif  // MULTILORA_AVX2

#ifdef MULTILORA_AMX

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
constexpr long kXfeatureXtiledata = 18;     // the AMX tile data

// Linux hands out the AMX tile state only to a process that asks for it (once, for all threads).
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Eight tiles of 16 rows x 64 bytes: C in 0-3 (16 x 16 f32), A in 4-5 (16 x 32 bf16), B in 6-7.
void configure_tiles() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

constexpr int64_t kAhead = 4;  // K steps of W prefetched ahead

// Pairs of 16-column blocks, for all rows: 32 rows at a time, two A and two B tiles per step of
// 32 along K into four C tiles; a pair's B panel stays in cache across row blocks.
void gemm_pair(int64_t j, const uint16_t* a, const uint16_t* w, int64_t Mp, int64_t Kp, int64_t I,
               int64_t T, int64_t N, float* y) {
  alignas(64) float tmp[2][2][16 * 16];
  const uint16_t* b0 = w + j * I * 512;
  const uint16_t* b1 = b0 + I * 512;
  const int64_t n0 = j * 16;
  for (int64_t m = 0; m < Mp; m += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* a0 = a + m * Kp;
    const uint16_t* a1 = a0 + 16 * Kp;
    for (int64_t i = 0; i < I; ++i) {
      if (m == 0 && i + kAhead < I)  // the first pass streams W from memory: fetch ahead
        for (int64_t line = 0; line < 16; ++line) {
          _mm_prefetch(reinterpret_cast<const char*>(b0 + (i + kAhead) * 512 + line * 32), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(b1 + (i + kAhead) * 512 + line * 32), _MM_HINT_T0);
        }
      _tile_loadd(4, a0 + i * 32, Kp * 2);
      _tile_loadd(5, a1 + i * 32, Kp * 2);
      _tile_loadd(6, b0 + i * 512, 64);
      _tile_loadd(7, b1 + i * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    const bool full = m + 32 <= T && n0 + 32 <= N;
    if (full) {
      float* out = y + m * N + n0;
      _tile_stored(0, out, N * 4);
      _tile_stored(1, out + 16, N * 4);
      _tile_stored(2, out + 16 * N, N * 4);
      _tile_stored(3, out + 16 * N + 16, N * 4);
      continue;
    }
    _tile_stored(0, tmp[0][0], 64);
    _tile_stored(1, tmp[0][1], 64);
    _tile_stored(2, tmp[1][0], 64);
    _tile_stored(3, tmp[1][1], 64);
    for (int64_t hm = 0; hm < 2; ++hm)
      for (int64_t r = 0; r < 16 && m + hm * 16 + r < T; ++r)
        for (int64_t hn = 0; hn < 2; ++hn) {
          const int64_t col = n0 + hn * 16, cols = std::min<int64_t>(16, N - col);
          if (cols > 0) std::memcpy(y + (m + hm * 16 + r) * N + col, tmp[hm][hn] + r * 16, cols * 4);
        }
  }
}

void gemm_block(const Block& blk, const uint16_t* a, const uint16_t* w, int64_t Mp, int64_t Kp,
                int64_t I, int64_t T, int64_t N, float* y) {
  configure_tiles();
  for (int64_t j = blk.j0; j < blk.j1; j += 2) gemm_pair(j, a, w, Mp, Kp, I, T, N, y);
  _tile_release();
}

#endif  // MULTILORA_AMX

// Contiguous, even runs of column blocks, one per thread (the pool's and this one, at most one
// per core): each streams its part of W in order (and, on AMX, configures the tiles once).
std::vector<Block> column_runs(ffi::ThreadPool& pool, int64_t J) {
  const int64_t pairs = J / 2;
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>({pairs, cores, pool.num_threads() + 1}));
  std::vector<Block> blocks;
  for (int64_t p = 0; p < parts; ++p) blocks.push_back({2 * (pairs * p / parts), 2 * (pairs * (p + 1) / parts)});
  return blocks;
}

// isa: what multilora.kernels.BF16_GEMM_ISAS names at that index: 1 AVX2 + FMA, 2 VDPBF16PS,
// 3 the AMX tiles (multilora.kernels.bf16_gemm_isa says which this build and CPU can run).
// rows: x's rows from this one on are the step's padding (a bucket's tokens past the step's own,
// or logits rows past its sequences'): they are not multiplied, and y's rows there are zeros. A
// row's sums do not depend on the other rows, so the live rows' bits are the same either way.
ffi::Error GemmBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x_TK, ffi::Buffer<ffi::BF16> w_LJIRC,
                    ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y_TN,
                    int64_t isa) {
  auto xd = x_TK.dimensions();
  auto wd = w_LJIRC.dimensions();
  auto yd = y_TN->dimensions();
  if (xd.size() != 2 || wd.size() != 5 || yd.size() != 2 || yd[0] != xd[0] || wd[3] != 16 || wd[4] != 32 ||
      wd[1] % 2 != 0 || wd[2] * 32 < xd[1] || wd[1] * 16 < yd[1] || rows.element_count() != 1)
    return ffi::Error::InvalidArgument("multilora gemm bf16: operand shapes disagree");
  const int64_t T = std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]);
  const int64_t K = xd[1], N = yd[1], L = wd[0], J = wd[1], I = wd[2], Kp = I * 32;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(w_LJIRC.typed_data()) +
                      clamp_layer(layer.typed_data()[0], L) * J * I * 512;
  float* y = y_TN->typed_data();
  if (T < xd[0]) std::memset(y + T * N, 0, sizeof(float) * (xd[0] - T) * N);
  if (T == 0) return ffi::Error::Success();
  const std::vector<Block> runs = column_runs(pool, J);
  if (isa == 3) {
#ifdef MULTILORA_AMX
    if (!amx_permitted()) return ffi::Error::Internal("multilora gemm bf16: Linux refused the AMX tile state");
    const int64_t Mp = (T + 31) / 32 * 32;
    std::vector<uint16_t> a(Mp * Kp);
    to_bf16(x_TK.typed_data(), T, K, Mp, Kp, a.data());
    parallel_items(pool, runs, [&](const Block& b) { gemm_block(b, a.data(), w, Mp, Kp, I, T, N, y); });
    return ffi::Error::Success();
#else
    return ffi::Error(ffi::ErrorCode::kUnimplemented, "multilora gemm bf16: built without AMX-BF16");
#endif
  }
  if (isa == 2) {
#ifdef MULTILORA_AVX512BF16
    std::vector<uint16_t> a(T * Kp);
    to_bf16(x_TK.typed_data(), T, K, T, Kp, a.data());
    parallel_items(pool, runs, [&](const Block& b) { dp_blocks(b.j0, b.j1, a.data(), w, T, Kp, I, N, y); });
    return ffi::Error::Success();
#else
    return ffi::Error(ffi::ErrorCode::kUnimplemented, "multilora gemm bf16: built without AVX512-BF16");
#endif
  }
  if (isa == 1) {
#ifdef MULTILORA_AVX2
    // x read in place, pairs of its columns; an odd K gets a copy with a zero column (W's packed
    // rows past K are zeros, x's past K are not there to read)
    const int64_t pairs = (K + 1) / 2;
    std::vector<float> padded(K % 2 ? T * 2 * pairs : 0, 0.f);
    for (int64_t t = 0; K % 2 && t < T; ++t) std::memcpy(padded.data() + t * 2 * pairs, x_TK.typed_data() + t * K, K * 4);
    const float* x = K % 2 ? padded.data() : x_TK.typed_data();
    parallel_items(pool, runs, [&](const Block& b) { fma_blocks(b.j0, b.j1, x, 2 * pairs, w, T, pairs, I, N, y); });
    return ffi::Error::Success();
#else
    return ffi::Error(ffi::ErrorCode::kUnimplemented, "multilora gemm bf16: built without AVX2 and FMA");
#endif
  }
  return ffi::Error::InvalidArgument("multilora gemm bf16: isa must be 1 (avx2), 2 (avx512-bf16) or 3 (amx)");
}

}  // namespace

// What gemm_bf16 can run on this build and CPU, one bit each: 1 AVX2 + FMA, 2 VDPBF16PS, 4 AMX
// (multilora.kernels.KERNEL_ISAS in order).
extern "C" int MultiloraKernelIsas() {
  int isas = 0;
#ifdef MULTILORA_AVX2
  isas |= 1;
#endif
#ifdef MULTILORA_AVX512BF16
  isas |= 2;
#endif
#ifdef MULTILORA_AMX
  if (amx_permitted()) isas |= 4;
#endif
  return isas;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiloraGemmBf16, GemmBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("isa"));
