// Per-token LoRA shrink and expand for the CPU, reading the adapters' rows in place.
//
// XLA's CPU backend runs a per-token gather (bgmv) as a copy of each token's adapter matrices
// followed by a batched matrix-vector product: the copy costs more than the product. These
// kernels read each token's rows straight out of the whole (L, blocks * U, X) pool of rank rows
// (multilora/lora/pool.py), found through the slot's row table, at the layer given as an operand
// (so the scan over layers copies nothing), visit a step's tokens grouped by slot (a slot's rows
// stay in cache while its tokens use them), and stop at each slot's true rank.
//
// shrink: h_TR[t, j*R + r] = scale[s] * dot(x_TD[t], A[layer, j*U + rows[s, r]])   for r < rank[s]
// expand: y_TO[t]          = sum_{r < rank[s]} h_TR[t, r] * B[layer, rows[s, r]]
// with s = slot_T[t]; rows of slot 0 (the base model) are zero.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using multilora::clamp_layer;
using multilora::parallel_items;

constexpr int64_t kRows = 4;   // tokens of one slot handled together: each weight row is read once
constexpr int64_t kLanes = 16; // output features per register block in the expand
constexpr int64_t kStackRows = 256;  // B row pointers kept on the stack up to this rank

// A work item: up to kRows tokens that share a slot.
struct Item {
  int64_t slot, n, tok[kRows];
};

// The step's tokens grouped by slot (base rows, slot 0, are left out), kRows at a time.
std::vector<Item> items_by_slot(const int32_t* slot_T, int64_t T, int64_t S) {
  std::vector<int64_t> count(S, 0);
  for (int64_t t = 0; t < T; ++t)
    if (slot_T[t] > 0 && slot_T[t] < S) count[slot_T[t]]++;
  std::vector<int64_t> start(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) start[s + 1] = start[s] + count[s];
  std::vector<int64_t> order(start[S]);
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < T; ++t)
    if (slot_T[t] > 0 && slot_T[t] < S) order[fill[slot_T[t]]++] = t;
  std::vector<Item> items;
  for (int64_t s = 1; s < S; ++s)
    for (int64_t i = start[s]; i < start[s + 1]; i += kRows) {
      Item it{s, std::min(kRows, start[s + 1] - i), {0, 0, 0, 0}};
      for (int64_t k = 0; k < it.n; ++k) it.tok[k] = order[i + k];
      items.push_back(it);
    }
  return items;
}

// Eight floats in a register (GCC/Clang vector extensions; -march=native picks the instructions).
typedef float f8 __attribute__((vector_size(32)));

inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// h[t, col] = scale * dot(x[t], row) for the N tokens of an item, the row read once: the N dots
// advance together, two vector accumulators each, so 2N independent FMA chains hide the FMA
// latency (one chain per dot was latency-bound).
template <int N>
void shrink_row(const Item& it, const float* __restrict x, int64_t D, const float* __restrict row,
                float scale, float* __restrict h, int64_t RT, int64_t col) {
  const float* xs[N];
  for (int k = 0; k < N; ++k) xs[k] = x + it.tok[k] * D;
  f8 acc[N][2] = {};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const f8 r0 = load8(row + d), r1 = load8(row + d + 8);
    for (int k = 0; k < N; ++k) {
      acc[k][0] += load8(xs[k] + d) * r0;
      acc[k][1] += load8(xs[k] + d + 8) * r1;
    }
  }
  for (int k = 0; k < N; ++k) {
    const f8 v = acc[k][0] + acc[k][1];
    float a = 0.f;
    for (int i = 0; i < 8; ++i) a += v[i];
    for (int64_t e = d; e < D; ++e) a += xs[k][e] * row[e];
    h[it.tok[k] * RT + col] = scale * a;
  }
}

// y[t, :] = sum_r h[t, r] * B[r, :] for the N tokens of an item: each block of kLanes outputs
// is accumulated in registers while the rank's rows stream by (B read once per item).
template <int N>
void expand_item(const Item& it, const float* __restrict hp, int64_t R, int64_t rank,
                 const float* const* b_rows, int64_t O, float* __restrict y) {
  const float* h[N];
  for (int k = 0; k < N; ++k) h[k] = hp + it.tok[k] * R;
  int64_t o0 = 0;
  for (; o0 + kLanes <= O; o0 += kLanes) {
    float acc[N][kLanes] = {};
    for (int64_t r = 0; r < rank; ++r) {
      const float* row = b_rows[r] + o0;
      for (int k = 0; k < N; ++k) {
        const float c = h[k][r];
#pragma omp simd
        for (int i = 0; i < kLanes; ++i) acc[k][i] += c * row[i];
      }
    }
    for (int k = 0; k < N; ++k) std::memcpy(y + it.tok[k] * O + o0, acc[k], sizeof(float) * kLanes);
  }
  for (; o0 < O; ++o0)
    for (int k = 0; k < N; ++k) {
      float acc = 0.f;
      for (int64_t r = 0; r < rank; ++r) acc += h[k][r] * b_rows[r][o0];
      y[it.tok[k] * O + o0] = acc;
    }
}

// The pool row of each of a slot's rank rows (rows_SR[s, r], clamped into the pool's U rows).
inline int64_t pool_row(const int32_t* rows, int64_t s, int64_t R, int64_t r, int64_t U) {
  const int64_t u = rows[s * R + r];
  return u < 0 ? 0 : (u >= U ? U - 1 : u);
}

ffi::Error Shrink(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x_TD, ffi::Buffer<ffi::F32> a_LUD,
                  ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slot_T,
                  ffi::Buffer<ffi::F32> scalings_S, ffi::Buffer<ffi::S32> ranks_S,
                  ffi::Buffer<ffi::S32> rows_SR, ffi::ResultBuffer<ffi::F32> h_TR, int64_t blocks) {
  auto xd = x_TD.dimensions();
  auto ad = a_LUD.dimensions();
  auto rd = rows_SR.dimensions();
  if (xd.size() != 2 || ad.size() != 3 || rd.size() != 2 || ad[2] != xd[1] || blocks < 1 ||
      ad[1] % blocks || slot_T.element_count() != xd[0] || scalings_S.element_count() != rd[0] ||
      ranks_S.element_count() != rd[0])
    return ffi::Error::InvalidArgument("multilora lora shrink: operand shapes disagree");
  const int64_t T = xd[0], D = xd[1], L = ad[0], U = ad[1] / blocks, S = rd[0], R = rd[1];
  const int64_t RT = blocks * R;
  const float* x = x_TD.typed_data();
  const float* a = a_LUD.typed_data() + clamp_layer(layer.typed_data()[0], L) * ad[1] * D;
  const float* scalings = scalings_S.typed_data();
  const int32_t* ranks = ranks_S.typed_data();
  const int32_t* rows = rows_SR.typed_data();
  float* h = h_TR->typed_data();
  std::memset(h, 0, sizeof(float) * T * RT);
  const std::vector<Item> items = items_by_slot(slot_T.typed_data(), T, S);
  parallel_items(pool, items, [&](const Item& it) {
    const int64_t rank = std::min<int64_t>(std::max<int32_t>(ranks[it.slot], 0), R);
    const float scale = scalings[it.slot];
    for (int64_t j = 0; j < blocks; ++j)
      for (int64_t r = 0; r < rank; ++r) {
        const float* row = a + (j * U + pool_row(rows, it.slot, R, r, U)) * D;
        switch (it.n) {
          case 1: shrink_row<1>(it, x, D, row, scale, h, RT, j * R + r); break;
          case 2: shrink_row<2>(it, x, D, row, scale, h, RT, j * R + r); break;
          case 3: shrink_row<3>(it, x, D, row, scale, h, RT, j * R + r); break;
          default: shrink_row<4>(it, x, D, row, scale, h, RT, j * R + r);
        }
      }
  });
  return ffi::Error::Success();
}

ffi::Error Expand(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h_TR, ffi::Buffer<ffi::F32> b_LUO,
                  ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slot_T,
                  ffi::Buffer<ffi::S32> ranks_S, ffi::Buffer<ffi::S32> rows_SR,
                  ffi::ResultBuffer<ffi::F32> y_TO) {
  auto hd = h_TR.dimensions();
  auto bd = b_LUO.dimensions();
  auto rd = rows_SR.dimensions();
  if (hd.size() != 2 || bd.size() != 3 || rd.size() != 2 || rd[1] != hd[1] ||
      slot_T.element_count() != hd[0] || ranks_S.element_count() != rd[0])
    return ffi::Error::InvalidArgument("multilora lora expand: operand shapes disagree");
  const int64_t T = hd[0], R = hd[1], L = bd[0], U = bd[1], O = bd[2], S = rd[0];
  const float* hp = h_TR.typed_data();
  const float* b = b_LUO.typed_data() + clamp_layer(layer.typed_data()[0], L) * U * O;
  const int32_t* ranks = ranks_S.typed_data();
  const int32_t* rows = rows_SR.typed_data();
  float* y = y_TO->typed_data();
  std::memset(y, 0, sizeof(float) * T * O);
  const std::vector<Item> items = items_by_slot(slot_T.typed_data(), T, S);
  parallel_items(pool, items, [&](const Item& it) {
    const int64_t rank = std::min<int64_t>(std::max<int32_t>(ranks[it.slot], 0), R);
    const float* on_stack[kStackRows];  // the slot's B rows, found through its table once
    std::vector<const float*> on_heap(rank > kStackRows ? rank : 0);
    const float** b_rows = rank > kStackRows ? on_heap.data() : on_stack;
    for (int64_t r = 0; r < rank; ++r) b_rows[r] = b + pool_row(rows, it.slot, R, r, U) * O;
    switch (it.n) {
      case 1: expand_item<1>(it, hp, R, rank, b_rows, O, y); break;
      case 2: expand_item<2>(it, hp, R, rank, b_rows, O, y); break;
      case 3: expand_item<3>(it, hp, R, rank, b_rows, O, y); break;
      default: expand_item<4>(it, hp, R, rank, b_rows, O, y);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiloraLoraShrink, Shrink,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("blocks"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiloraLoraExpand, Expand,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
