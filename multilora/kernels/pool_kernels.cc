// Writing an adapter's rank rows into a LoRA pool in place (multilora/adapters/pool.py, write_rows).
//
// XLA's CPU backend runs a bfloat16 scatter, and even a bfloat16 dynamic-update-slice, in float32:
// it converts the whole pool to float32 and back around every write (seconds per adapter for a
// pool of gigabytes), and bit-casting the pool to uint16 around the scatter is materialized as two
// more whole-pool copies. This kernel writes only the rows: its result is aliased to the pool
// operand (input_output_aliases, the pool donated by the jitted writer), so XLA hands it the
// pool's own buffer; where it does not (no donation), the pool is copied first, once.
//
//   pool[l, rows[j], :] = round(new[l, j, :])   for every layer l and every j
//
// new is the pool's own dtype (rows copied as they are: host copies are read in the pool's dtype,
// multilora/adapters/adapter.py) or float32, which a bfloat16 pool gets rounded to nearest, ties to
// even (NaN stays NaN), as XLA's convert does. Row ids out of [0, U) are refused with an error,
// nothing written.

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline uint16_t to_bf16(float f) {
  uint32_t w;
  std::memcpy(&w, &f, sizeof w);
  if ((w & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((w >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((w + 0x7fffu + ((w >> 16) & 1u)) >> 16);
}

// T: the pool's element, S: new's (the same, or float32 into a bfloat16 pool: rounded).
template <typename T, typename S>
void write_rows(T* pool, int64_t L, int64_t U, int64_t X, const int32_t* rows, int64_t R,
                const S* src) {
  for (int64_t l = 0; l < L; ++l)
    for (int64_t j = 0; j < R; ++j) {
      T* dst = pool + (l * U + rows[j]) * X;
      const S* s = src + (l * R + j) * X;
      if constexpr (std::is_same_v<T, S>) {
        std::memcpy(dst, s, X * sizeof(T));
      } else {
        for (int64_t x = 0; x < X; ++x) dst[x] = to_bf16(s[x]);
      }
    }
}

ffi::Error PoolWrite(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> rows_R, ffi::AnyBuffer new_LRX,
                     ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = pool.dimensions();
  const auto ndims = new_LRX.dimensions();
  if (dims.size() != 3 || ndims.size() != 3 || rows_R.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("pool_write: pool (L, U, X), rows (R,), new (L, R, X) expected");
  const int64_t L = dims[0], U = dims[1], X = dims[2], R = rows_R.dimensions()[0];
  if (ndims[0] != L || ndims[1] != R || ndims[2] != X)
    return ffi::Error::InvalidArgument("pool_write: new rows' shape does not match the pool and rows");
  const int32_t* rows = rows_R.typed_data();
  for (int64_t j = 0; j < R; ++j)
    if (rows[j] < 0 || rows[j] >= U)
      return ffi::Error::InvalidArgument("pool_write: row " + std::to_string(rows[j]) + " is outside the pool's " +
                                         std::to_string(U) + " rows");
  if (out->untyped_data() != pool.untyped_data())  // not aliased: start from a copy of the pool
    std::memcpy(out->untyped_data(), pool.untyped_data(), pool.size_bytes());
  const auto pt = pool.element_type(), nt = new_LRX.element_type();
  const bool f32_new = nt == ffi::DataType::F32;
  if ((pt != ffi::DataType::F32 && pt != ffi::DataType::BF16) || (nt != pt && !f32_new))
    return ffi::Error::InvalidArgument(
        "pool_write: the pool must be float32 or bfloat16, and the new rows float32 or the pool's dtype");
  if (pt == ffi::DataType::F32)
    write_rows(static_cast<float*>(out->untyped_data()), L, U, X, rows, R,
               static_cast<const float*>(new_LRX.untyped_data()));
  else if (f32_new)
    write_rows(static_cast<uint16_t*>(out->untyped_data()), L, U, X, rows, R,
               static_cast<const float*>(new_LRX.untyped_data()));
  else
    write_rows(static_cast<uint16_t*>(out->untyped_data()), L, U, X, rows, R,
               static_cast<const uint16_t*>(new_LRX.untyped_data()));
  return ffi::Error::Success();
}

}  // namespace

// n float32 values rounded to bfloat16 as above, for adapters read on the loader's threads
// (multilora/adapters/adapter.py, called through ctypes, which drops the GIL): the loop vectorizes,
// where numpy's cast through ml_dtypes takes ~0.9 ns a value (4.6 ms of a rank-16 adapter's read).
extern "C" void multilora_round_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i]);
}

// An adapter's tensors copied out of its file's bytes into its host copy, converted, scaled and
// checked in one pass (multilora/adapters/adapter.py, called through ctypes, which drops the GIL):
// one call per module instead of a numpy cast, a scaling and a finite check per tensor. A job is
// eight int64: the tensor's byte offset in src, its dtype (0 float32, 1 bfloat16), its first
// element in dst, its rows and columns, the row strides of src and dst in elements, and a float32
// scale by its bits (pattern scalings folded into B; 1.0 copies). dst is float32 (0) or bfloat16
// (1): a float32 value goes to bfloat16 rounded to nearest even (as to_bf16 above), scaled in
// float32 first, so each value is rounded once. Returns the first job whose output holds a NaN or
// an Inf (a value beyond bfloat16's range included), or -1; every job is copied either way.
namespace {

inline float from_bf16(uint16_t b) {
  const uint32_t w = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

template <typename S, typename D>
bool copy_job(const S* src, D* dst, int64_t rows, int64_t cols, int64_t src_stride, int64_t dst_stride,
              float scale) {
  constexpr bool kSameBits = std::is_same_v<S, D>;
  uint32_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const S* s = src + r * src_stride;
    D* d = dst + r * dst_stride;
    if constexpr (kSameBits) {
      if (scale == 1.0f) {
        std::memcpy(d, s, cols * sizeof(D));
        for (int64_t c = 0; c < cols; ++c) {
          if constexpr (std::is_same_v<D, float>) {
            uint32_t w;
            std::memcpy(&w, &d[c], sizeof w);
            bad |= (w & 0x7f800000u) == 0x7f800000u;
          } else {
            bad |= (d[c] & 0x7f80u) == 0x7f80u;
          }
        }
        continue;
      }
    }
    for (int64_t c = 0; c < cols; ++c) {
      float f;
      if constexpr (std::is_same_v<S, float>) f = s[c]; else f = from_bf16(s[c]);
      f *= scale;
      if constexpr (std::is_same_v<D, float>) {
        d[c] = f;
        uint32_t w;
        std::memcpy(&w, &f, sizeof w);
        bad |= (w & 0x7f800000u) == 0x7f800000u;
      } else {
        d[c] = to_bf16(f);
        bad |= (d[c] & 0x7f80u) == 0x7f80u;
      }
    }
  }
  return bad != 0;
}

template <typename D>
bool run_job(const char* src_base, D* dst_base, const int64_t* j) {
  float scale;
  const uint32_t bits = static_cast<uint32_t>(j[7]);
  std::memcpy(&scale, &bits, sizeof scale);
  D* dst = dst_base + j[2];
  if (j[1] == 0)
    return copy_job(reinterpret_cast<const float*>(src_base + j[0]), dst, j[3], j[4], j[5], j[6], scale);
  return copy_job(reinterpret_cast<const uint16_t*>(src_base + j[0]), dst, j[3], j[4], j[5], j[6], scale);
}

}  // namespace

extern "C" int64_t multilora_copy_tensors(const char* src, void* dst, int32_t dst_kind, const int64_t* jobs,
                                          int64_t n_jobs) {
  int64_t first_bad = -1;
  for (int64_t i = 0; i < n_jobs; ++i) {
    const bool bad = dst_kind == 0 ? run_job(src, static_cast<float*>(dst), jobs + 8 * i)
                                   : run_job(src, static_cast<uint16_t*>(dst), jobs + 8 * i);
    if (bad && first_bad < 0) first_bad = i;
  }
  return first_bad;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiloraPoolWrite, PoolWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
