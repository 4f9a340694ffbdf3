// The base model's projections in bfloat16 on Intel AMX, reading one layer of the stacked,
// pre-packed weights in place.
//
// y_TN = x_TK @ W[layer]  (x float32, rounded to bfloat16 to nearest even; W bfloat16; the
// products accumulated in float32: the same numbers as XLA's bf16 x bf16 -> f32 dot, summed in
// another order).
//
// XLA's CPU backend slices each layer's weights out of the (L, K, N) stack by copying them
// before every GEMM of the layer scan, and its GEMMs use AVX-512 FMAs at best. This kernel takes
// the whole stack and the layer index as operands (the scan copies nothing) and multiplies
// with the AMX tile unit (TDPBF16PS: a 16 x 16 f32 tile += a 16 x 32 bf16 tile times a 32 x 16
// one, per instruction).
//
// The weights are packed once, at load time (multilora.kernels.pack_bf16), into the tiles' own
// layout, so each tile of B is one contiguous KiB:
//   w_LJIRC[l, j, i, r, 2 c + e] = W[l][32 i + 2 r + e, 16 j + c]   (zero past K or N)
// with J = ceil(N / 32) * 2 column blocks of 16 and I = ceil(K / 32) row blocks of 32.
//
// Built only where the compiler targets AMX-BF16 (-march=native on such a CPU); elsewhere the
// handler reports that it is unavailable and multilora.kernels.amx_available() is False.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define MULTILORA_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using multilora::clamp_layer;
using multilora::parallel_items;

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

constexpr int64_t kAhead = 4;  // K steps of W prefetched ahead

struct Block {
  int64_t j0, j1;  // 16-column blocks [j0, j1), taken two at a time
};

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

ffi::Error GemmBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x_TK, ffi::Buffer<ffi::BF16> w_LJIRC,
                    ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y_TN) {
#ifdef MULTILORA_AMX
  auto xd = x_TK.dimensions();
  auto wd = w_LJIRC.dimensions();
  auto yd = y_TN->dimensions();
  if (xd.size() != 2 || wd.size() != 5 || yd.size() != 2 || yd[0] != xd[0] || wd[3] != 16 || wd[4] != 32 ||
      wd[1] % 2 != 0 || wd[2] * 32 < xd[1] || wd[1] * 16 < yd[1])
    return ffi::Error::InvalidArgument("multilora gemm bf16: operand shapes disagree");
  if (!amx_permitted()) return ffi::Error::Internal("multilora gemm bf16: Linux refused the AMX tile state");
  const int64_t T = xd[0], K = xd[1], N = yd[1], L = wd[0], J = wd[1], I = wd[2];
  const int64_t Mp = (T + 31) / 32 * 32, Kp = I * 32;
  std::vector<uint16_t> a(Mp * Kp);
  to_bf16(x_TK.typed_data(), T, K, Mp, Kp, a.data());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(w_LJIRC.typed_data()) +
                      clamp_layer(layer.typed_data()[0], L) * J * I * 512;
  float* y = y_TN->typed_data();
  // One contiguous run of column pairs per thread (the pool's and this one, at most one per
  // core): each configures the tiles once and streams its part of W in order.
  const int64_t pairs = J / 2;
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>({pairs, cores, pool.num_threads() + 1}));
  std::vector<Block> blocks;
  for (int64_t p = 0; p < parts; ++p) blocks.push_back({2 * (pairs * p / parts), 2 * (pairs * (p + 1) / parts)});
  parallel_items(pool, blocks, [&](const Block& b) { gemm_block(b, a.data(), w, Mp, Kp, I, T, N, y); });
  return ffi::Error::Success();
#else
  return ffi::Error::Unimplemented("multilora gemm bf16: built without AMX-BF16");
#endif
}

}  // namespace

// 1 where this build has the AMX kernel and Linux grants the tile state; 0 elsewhere.
extern "C" int MultiloraAmxAvailable() {
#ifdef MULTILORA_AMX
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiloraGemmBf16, GemmBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
