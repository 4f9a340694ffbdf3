// Per-token LoRA shrink and expand for the CPU, reading the adapters' rows in place.
//
// XLA's CPU backend runs a per-token gather (bgmv) as a copy of each token's adapter matrices
// followed by a batched matrix-vector product: the copy costs more than the product. These
// kernels read each token's rows straight out of the whole (L, blocks * U, X) pool of rank rows
// (multilora/adapters/pool.py), found through the slot's row table, at the layer given as an operand
// (so the scan over layers copies nothing), visit a step's tokens grouped by slot (a slot's rows
// stay in cache while its tokens use them), and stop at each slot's true rank.
//
// shrink: h_TR[t, j*R + r] = scale[s] * dot(x_TD[t], A[layer, j*U + rows[s, r]])   for r < rank[s]
// expand: y_TO[t]          = sum_{r < rank[s]} h_TR[t, r] * B[layer, rows[s, r]]
// with s = slot_T[t]; rows of slot 0 (the base model) are zero.
//
// The pool is float32 or bfloat16 (the engine's bf16 pool, half the bytes a step reads): bf16 rows
// are widened to float32 in registers, and x, h and every sum stay float32. Work is done in
// 16-lane vectors (GCC/Clang vector extensions; one zmm register with AVX-512, two explicit ymm halves
// without, where GCC lowered a 64-byte vector through the stack: see f16v).
// Except: the group call (Apply, what the model runs) on a bf16 pool where the CPU has
// AVX512-BF16 (and multilora.kernels.bf16_gemm_isa() says it may run: its dot_bf16 attribute)
// multiplies bf16 pairs (VDPBF16PS: x rounded to bf16 for the shrink, h for the
// expand, as a bf16 PEFT layer rounds them; products exact, sums float32), half the instructions
// and no widening: 0.75x the time of the widened path with one adapter on 64 tokens (compute
// bound), the same with 40 (memory bound); benchmarks/log/17-2026-12-04-bf16-dot-products-lora-kernel.md. The float32 pool stays the exact path.
//
// In a step with tens of adapters an item is one adapter's rows for one or two tokens: it ends
// before the hardware prefetchers have learnt its streams, and the reads ran at about half the
// machine's streaming rate. The group call therefore splits its items into contiguous runs, one
// per core, and each item fetches the next one's rows while it computes (as many lines as it has
// just read): 0.74-0.80x the time with 40 adapters, float32 or bf16 pools (benchmarks/log/17-2026-12-04-bf16-dot-products-lora-kernel.md).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#include "parallel.h"
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using multilora::clamp_layer;
using multilora::parallel_items;

#if defined(__AVX512F__)
constexpr int64_t kRows = 8;   // tokens of one slot handled together: each weight row is read once
#else
constexpr int64_t kRows = 6;   // 16 vector registers: a shrink's 6 x 2 accumulators and its row,
                               // an expand's 6 x 2 and its B row and h, fit (12 of 16)
#endif
constexpr int64_t kStackRows = 256;
constexpr int64_t kAhead = 256;      // elements of a weight row fetched ahead of their use  // B row pointers kept on the stack up to this rank

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
      Item it{s, std::min(kRows, start[s + 1] - i), {}};
      for (int64_t k = 0; k < it.n; ++k) it.tok[k] = order[i + k];
      items.push_back(it);
    }
  return items;
}

// Sixteen floats in a vector; -march=native picks the instructions.
typedef float f8v __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

using bf16 = uint16_t;  // the pool's bfloat16 rows, by their bits

// A vector V of floats from p.
template <typename V>
inline V loaded(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A vector F of the bf16 values at p, widened: bf16 -> f32 is exact, the bits shifted into the
// high half (U16, U32: the same lanes as 16- and 32-bit integers).
template <typename F, typename U16, typename U32>
inline F widened(const bf16* p) {
  U16 h;
  std::memcpy(&h, p, sizeof h);
  const U32 w = __builtin_convertvector(h, U32) << 16;
  F v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

#if defined(__AVX512F__)
typedef float f16v __attribute__((vector_size(64)));  // one zmm register

inline f16v load16(const float* p) { return loaded<f16v>(p); }
inline f16v load16(const bf16* p) { return widened<f16v, u16x16, u32x16>(p); }
inline void store16(float* p, const f16v& v) { std::memcpy(p, &v, sizeof v); }

inline f8v low8(f16v v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
inline f8v high8(f16v v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }
#else
// Without AVX-512, two ymm halves: GCC lowers a 64-byte vector extension through the stack there
// (on -march=znver2 every scalar times a vector stored its scalar 16 times to memory, and the
// expand's accumulators went through the stack at each rank row), so the halves are explicit;
// lane for lane the same operations, so the same results.
struct f16v {
  f8v lo, hi;
  f16v& operator+=(const f16v& o) {
    lo += o.lo;
    hi += o.hi;
    return *this;
  }
  friend f16v operator*(const f16v& a, const f16v& b) { return {a.lo * b.lo, a.hi * b.hi}; }
  friend f16v operator*(float c, const f16v& b) { return {c * b.lo, c * b.hi}; }
};
static_assert(sizeof(f16v) == 64, "16 floats in order");

inline f16v load16(const float* p) { return {loaded<f8v>(p), loaded<f8v>(p + 8)}; }
inline f16v load16(const bf16* p) { return {widened<f8v, u16x8, u32x8>(p), widened<f8v, u16x8, u32x8>(p + 8)}; }

// A half at a time, each straight from its register: a memcpy of the halves (or of the whole)
// went through the stack, the expand's accumulators stored there and copied out 16 bytes at a time.
inline void store16(float* p, const f16v& v) {
#if defined(__AVX__)
  _mm256_storeu_ps(p, (__m256)v.lo);
  _mm256_storeu_ps(p + 8, (__m256)v.hi);
#else
  std::memcpy(p, &v.lo, sizeof v.lo);
  std::memcpy(p + 8, &v.hi, sizeof v.hi);
#endif
}

inline f8v low8(const f16v& v) { return v.lo; }
inline f8v high8(const f16v& v) { return v.hi; }
#endif

inline float widen(float x) { return x; }
inline float widen(bf16 b) {
  const uint32_t w = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

inline float hsum(const f16v& v) {
  const f8v a = low8(v) + high8(v);
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += a[i];
  return s;
}

// The next item's rows (its A rows of every block, then its B rows), fetched into cache a few lines
// at a time while the current item computes, as many lines as the current one has just read: an
// item is one adapter's rows for one or two tokens in a step with tens of adapters, so it ends
// before the hardware prefetchers have learnt its streams.
struct NextRows {
  struct Run {
    const char* p;  // 64-byte aligned
    int64_t lines;
  };
  std::vector<Run> runs;
  size_t run = 0;
  int64_t line = 0;

  template <typename W>
  void add(const W* p, int64_t n) {
    const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63);
    const uintptr_t last = (reinterpret_cast<uintptr_t>(p + n) - 1) & ~uintptr_t(63);
    runs.push_back({reinterpret_cast<const char*>(first), static_cast<int64_t>((last - first) / 64 + 1)});
  }
  void fetch(int64_t n) {
    for (; n > 0 && run < runs.size(); --n) {
      __builtin_prefetch(runs[run].p + 64 * line, 0, 2);
      if (++line == runs[run].lines) ++run, line = 0;
    }
  }
};

// Runs fn(item, next) for every item, next the item's successor's rows being fetched (nullptr for
// the last of a run, and for a successor of the same slot: its rows are the ones this item reads,
// in cache already; fetching them again cost one adapter's 64 tokens ~0.6 ms of their ~3.7 ms,
// benchmarks/lora_groups.py): the items split into contiguous runs balanced by weight (a token's
// arithmetic plus an item's rows, two tokens' worth), one per core.
template <typename RowsOf, typename Fn>
void items_fetching_ahead(ffi::ThreadPool& pool, const std::vector<Item>& items, const RowsOf& rows_of,
                          const Fn& fn) {
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>({n_items, cores, pool.num_threads() + 1}));
  int64_t total = 0;
  for (const Item& it : items) total += it.n + 2;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t i = 0, acc = 0, p = 0; p < parts; ++p) {
    const int64_t begin = i;
    while (i < n_items && (p == parts - 1 || (acc + items[i].n + 2) * parts <= total * (p + 1))) acc += items[i++].n + 2;
    if (i == begin && i < n_items) acc += items[i++].n + 2;  // every run takes at least one item
    ranges.push_back({begin, i});
  }
  parallel_items(pool, ranges, [&](const std::pair<int64_t, int64_t>& r) {
    for (int64_t i = r.first; i < r.second; ++i) {
      NextRows next;
      if (i + 1 < r.second && items[i + 1].slot != items[i].slot) rows_of(items[i + 1], next);
      fn(items[i], next.runs.empty() ? nullptr : &next);
    }
  });
}

// Accumulator chains per token in a shrink, the same whatever the item's token count N: a token's
// sums never depend on how many tokens of its adapter share its item, and so its results are the
// same bits whatever else its step holds. (Two chains for fewer than four tokens and one for more
// made a token's LoRA delta, in its last bits, depend on the batch: a greedy token of the 64-adapter
// serving run flipped when faster reads admitted requests at other steps; benchmarks/log/26-2026-12-05-adapter-reads-native-pass.md.) Two where
// 32 vector registers hold N * 2 accumulators (AVX-512); one where there are 16.
constexpr int kChains = kRows >= 8 ? 2 : 1;

// hout[k][col] = scale * dot(x[tok k], row) for the N tokens of an item, the row read once: the
// N dots advance together (independent FMA chains hide the FMA latency).
template <int N, typename W>
void shrink_row(const Item& it, const float* __restrict x, int64_t D, const W* __restrict row,
                float scale, float* const* hout, int64_t col, NextRows* next = nullptr) {
  constexpr int C = kChains;  // accumulators per token
  const float* xs[N];
  for (int k = 0; k < N; ++k) xs[k] = x + it.tok[k] * D;
  f16v acc[N][C] = {};
  int64_t d = 0;
  for (; d + 16 * C <= D; d += 16 * C) {
    __builtin_prefetch(row + d + kAhead);
    for (int c = 0; c < C; ++c) {
      const f16v r = load16(row + d + 16 * c);
      for (int k = 0; k < N; ++k) acc[k][c] += load16(xs[k] + d + 16 * c) * r;
    }
  }
  for (; d + 16 <= D; d += 16) {
    const f16v r = load16(row + d);
    for (int k = 0; k < N; ++k) acc[k][0] += load16(xs[k] + d) * r;
  }
  for (int k = 0; k < N; ++k) {
    f16v v = acc[k][0];
    for (int c = 1; c < C; ++c) v += acc[k][c];
    float a = hsum(v);
    for (int64_t e = d; e < D; ++e) a += xs[k][e] * widen(row[e]);
    hout[k][col] = scale * a;
  }
  if (next) next->fetch((D * int64_t(sizeof(W)) + 63) / 64);
}

// yout[k][:] = sum_r hin[k][r] * B[r, :] for the N tokens of an item: each block of outputs is
// accumulated in registers while the rank's rows stream by (B read once per item).
#if defined(__AVX512F__)
constexpr int kExpandVecs = 2;  // outputs a block: 32, 2 zmm accumulators a token
#else
constexpr int kExpandVecs = 1;  // 16: 2 ymm a token (32 outputs for 4 tokens took all 16 registers; 6 tokens fit at 16)
#endif

template <int N, typename W>
void expand_item(const float* const* hin, int64_t rank, const W* const* b_rows, int64_t O,
                 float* const* yout, NextRows* next = nullptr) {
  constexpr int V = kExpandVecs;
  int64_t o0 = 0;
  for (; o0 + 16 * V <= O; o0 += 16 * V) {
    if (next) next->fetch(rank * int64_t(sizeof(W)) * V / 4);  // the lines this block reads
    f16v acc[N][V] = {};
    for (int64_t r = 0; r < rank; ++r) {
      // Each rank row is a separate stream, each read a block at a time: fetched ahead here
      // (the hardware prefetcher loses them at every page boundary).
      __builtin_prefetch(b_rows[r] + o0 + kAhead);
      f16v b[V];
      for (int v = 0; v < V; ++v) b[v] = load16(b_rows[r] + o0 + 16 * v);
      for (int k = 0; k < N; ++k) {
        const float c = hin[k][r];
        for (int v = 0; v < V; ++v) acc[k][v] += c * b[v];
      }
    }
    for (int k = 0; k < N; ++k)
      for (int v = 0; v < V; ++v) store16(yout[k] + o0 + 16 * v, acc[k][v]);
  }
  for (; o0 + 16 <= O; o0 += 16) {
    f16v acc[N] = {};
    for (int64_t r = 0; r < rank; ++r) {
      const f16v b0 = load16(b_rows[r] + o0);
      for (int k = 0; k < N; ++k) acc[k] += hin[k][r] * b0;
    }
    for (int k = 0; k < N; ++k) store16(yout[k] + o0, acc[k]);
  }
  for (; o0 < O; ++o0)
    for (int k = 0; k < N; ++k) {
      float acc = 0.f;
      for (int64_t r = 0; r < rank; ++r) acc += hin[k][r] * widen(b_rows[r][o0]);
      yout[k][o0] = acc;
    }
}

// fn(std::integral_constant<int, n>) for n in 1 .. kRows: an item's token count as a constant.
template <int N = 1, typename Fn>
inline void with_count(int64_t n, const Fn& fn) {
  if constexpr (N < kRows) {
    if (n > N) return with_count<N + 1>(n, fn);
  }
  fn(std::integral_constant<int, N>());
}

// The pool row of each of a slot's rank rows (rows_SR[s, r], clamped into the pool's U rows).
inline int64_t pool_row(const int32_t* rows, int64_t s, int64_t R, int64_t r, int64_t U) {
  const int64_t u = rows[s * R + r];
  return u < 0 ? 0 : (u >= U ? U - 1 : u);
}

// Row pointers of an item's tokens into a (T, X) matrix.
template <typename P>
void token_rows(const Item& it, P* base, int64_t X, P** out) {
  for (int64_t k = 0; k < it.n; ++k) out[k] = base + it.tok[k] * X;
}

// One slot's rank rows of one block of a pool layer, found through its row table once.
template <typename W>
struct SlotRows {
  const W* on_stack[kStackRows];
  std::vector<const W*> on_heap;
  const W** rows;
  SlotRows(const W* pool, int64_t X, const int32_t* table, int64_t s, int64_t R, int64_t rank, int64_t U)
      : on_heap(rank > kStackRows ? rank : 0), rows(rank > kStackRows ? on_heap.data() : on_stack) {
    for (int64_t r = 0; r < rank; ++r) rows[r] = pool + pool_row(table, s, R, r, U) * X;
  }
};

// The operands every kernel of this file shares: the step's tokens and its slots' tables.
struct Slots {
  const float* scalings;
  const int32_t* ranks;
  const int32_t* rows;
  int64_t R;
  int64_t rank(int64_t s) const { return std::min<int64_t>(std::max<int32_t>(ranks[s], 0), R); }
};

// h_k[j * R + r] for the item's tokens: its slot's rows of every block of the A pool layer.
template <int N, typename W>
void shrink_item(const Item& it, const float* x, int64_t D, const W* a, int64_t U, int64_t blocks,
                 const Slots& sl, float* const* hout, NextRows* next = nullptr) {
  const int64_t rank = sl.rank(it.slot);
  for (int64_t j = 0; j < blocks; ++j) {
    const SlotRows<W> rows(a + j * U * D, D, sl.rows, it.slot, sl.R, rank, U);
    for (int64_t r = 0; r < rank; ++r)
      shrink_row<N>(it, x, D, rows.rows[r], sl.scalings[it.slot], hout, j * sl.R + r, next);
  }
}

// An item's rows of a group: A's of every block, then B's of every block (in the order they are
// read), for NextRows.
template <typename W>
void group_rows(const Item& it, const W* a, int64_t D, int64_t U, int64_t blocks, const W* const* b,
                const int64_t* O, const Slots& sl, NextRows& out) {
  const int64_t rank = sl.rank(it.slot);
  for (int64_t j = 0; j < blocks; ++j)
    for (int64_t r = 0; r < rank; ++r) out.add(a + (j * U + pool_row(sl.rows, it.slot, sl.R, r, U)) * D, D);
  for (int64_t j = 0; j < blocks; ++j)
    for (int64_t r = 0; r < rank; ++r) out.add(b[j] + pool_row(sl.rows, it.slot, sl.R, r, U) * O[j], O[j]);
}

template <typename W>
void shrink_items(ffi::ThreadPool& pool, const std::vector<Item>& items, const float* x, int64_t D,
                  const W* a, int64_t U, int64_t blocks, const Slots& sl, float* h) {
  parallel_items(pool, items, [&](const Item& it) {
    float* hout[kRows];
    token_rows(it, h, blocks * sl.R, hout);
    with_count(it.n, [&](auto n) { shrink_item<decltype(n)::value>(it, x, D, a, U, blocks, sl, hout); });
  });
}

template <typename W>
void expand_items(ffi::ThreadPool& pool, const std::vector<Item>& items, const float* h, const W* b,
                  int64_t U, int64_t O, const Slots& sl, float* y) {
  parallel_items(pool, items, [&](const Item& it) {
    const SlotRows<W> rows(b, O, sl.rows, it.slot, sl.R, sl.rank(it.slot), U);
    const float* hin[kRows];
    float* yout[kRows];
    token_rows(it, h, sl.R, hin);
    token_rows(it, y, O, yout);
    with_count(it.n, [&](auto n) { expand_item<decltype(n)::value>(hin, sl.rank(it.slot), rows.rows, O, yout); });
  });
}

// A whole group in one pass over its items: the item's h stays local (its tokens only), then
// one expand per block. One call and one spread over the threads instead of 1 + blocks.
constexpr int64_t kMaxBlocks = 3;

template <typename W>
void apply_items(ffi::ThreadPool& pool, const std::vector<Item>& items, const float* x, int64_t D,
                 const W* a, int64_t U, int64_t blocks, const W* const* b, const int64_t* O,
                 const Slots& sl, float* const* y) {
  const int64_t RT = blocks * sl.R;
  auto rows_of = [&](const Item& it, NextRows& out) { group_rows(it, a, D, U, blocks, b, O, sl, out); };
  items_fetching_ahead(pool, items, rows_of, [&](const Item& it, NextRows* next) {
    std::vector<float> h(it.n * RT);
    float* hout[kRows];
    for (int64_t k = 0; k < it.n; ++k) hout[k] = h.data() + k * RT;
    with_count(it.n, [&](auto n) {
      constexpr int N = decltype(n)::value;
      shrink_item<N>(it, x, D, a, U, blocks, sl, hout, next);
      for (int64_t j = 0; j < blocks; ++j) {
        const SlotRows<W> rows(b[j], O[j], sl.rows, it.slot, sl.R, sl.rank(it.slot), U);
        const float* hin[kRows];
        float* yout[kRows];
        for (int k = 0; k < N; ++k) hin[k] = hout[k] + j * sl.R;
        token_rows(it, y[j], O[j], yout);
        expand_item<N>(hin, sl.rank(it.slot), rows.rows, O[j], yout, next);
      }
    });
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define MULTILORA_LORA_DP 1
// bfloat16 pools on a CPU with AVX512-BF16: the group call (Apply) multiplies pairs of bf16 values
// per lane (VDPBF16PS, 32 products an instruction, no widening): x is rounded to bf16 (nearest
// even) for the shrink and h for the expand, as a bf16 PEFT layer rounds them; the products are
// exact and the sums float32. The standalone shrink and expand keep the widened path.

// n (<= 32) floats from p rounded to 32 bf16 values, zeros past n.
inline __m512i round_bf16x32(const float* p, int64_t n) {
  const __mmask16 lo = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
  const __mmask16 hi = n >= 32 ? __mmask16(0xffff) : (n > 16 ? __mmask16((1u << (n - 16)) - 1) : __mmask16(0));
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, p + 16), _mm512_maskz_loadu_ps(lo, p));
}

inline __mmask32 first_lanes32(int64_t n) { return n >= 32 ? ~__mmask32(0) : ((__mmask32(1) << n) - 1); }

// x_TD rounded to bf16, each row padded with zeros to Dp (a multiple of 32).
void round_rows(const float* x, int64_t T, int64_t D, int64_t Dp, bf16* out) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < Dp; d += 32)
      _mm512_storeu_si512(out + t * Dp + d, round_bf16x32(x + t * D + d, std::max<int64_t>(0, std::min<int64_t>(32, D - d))));
}

// hout[k][col] = scale * dot(xb[tok k], row): as shrink_row, 32 elements an instruction; the
// row's tail is read masked (it ends at D), x's rows are padded with zeros to a multiple of 32.
template <int N>
void shrink_row_dp(const Item& it, const bf16* __restrict xb, int64_t Dp, int64_t D,
                   const bf16* __restrict row, float scale, float* const* hout, int64_t col,
                   NextRows* next) {
  constexpr int C = kChains;
  const bf16* xs[N];
  for (int k = 0; k < N; ++k) xs[k] = xb + it.tok[k] * Dp;
  __m512 acc[N][C];
  for (int k = 0; k < N; ++k)
    for (int c = 0; c < C; ++c) acc[k][c] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 * C <= D; d += 32 * C) {
    // into L2 (prefetcht1), as NextRows does: a prefetch into L1 holds one of its few miss
    // buffers until the line comes (5 % faster group calls with 40 adapters, lora_groups.py)
    __builtin_prefetch(row + d + kAhead, 0, 2);
    for (int c = 0; c < C; ++c) {
      const __m512bh r = (__m512bh)_mm512_loadu_si512(row + d + 32 * c);
      for (int k = 0; k < N; ++k)
        acc[k][c] = _mm512_dpbf16_ps(acc[k][c], (__m512bh)_mm512_loadu_si512(xs[k] + d + 32 * c), r);
    }
  }
  for (; d < D; d += 32) {
    const __m512bh r = (__m512bh)_mm512_maskz_loadu_epi16(first_lanes32(D - d), row + d);
    for (int k = 0; k < N; ++k) acc[k][0] = _mm512_dpbf16_ps(acc[k][0], (__m512bh)_mm512_loadu_si512(xs[k] + d), r);
  }
  for (int k = 0; k < N; ++k) {
    __m512 v = acc[k][0];
    for (int c = 1; c < C; ++c) v = _mm512_add_ps(v, acc[k][c]);
    hout[k][col] = scale * _mm512_reduce_add_ps(v);
  }
  if (next) next->fetch((D * 2 + 63) / 64);
}

// yout[k][:] = sum_r h[k][r] * B[r, :] with h as bf16 pairs (hpair[k][i] = h[2i], h[2i+1]): two
// rank rows interleaved by 16-bit lanes make VDPBF16PS's pairs. The interleave works within
// 128-bit lanes: lo holds columns 8q + j, hi 8q + 4 + j (q < 4, j < 4) of each 32; kUnLo/kUnHi put
// them back in order.
template <int N>
void expand_item_dp(const uint32_t* const* hpair, int64_t rank, const bf16* const* b_rows, int64_t O,
                    float* const* yout, NextRows* next) {
  static const __m512i kUnLo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  static const __m512i kUnHi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const int64_t pairs = (rank + 1) / 2;
  for (int64_t o0 = 0; o0 < O; o0 += 32) {
    const int64_t n = std::min<int64_t>(32, O - o0);
    const __mmask32 m = first_lanes32(n);
    __m512 acc[N][2];
    for (int k = 0; k < N; ++k) acc[k][0] = acc[k][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; ++i) {
      const bf16* r0 = b_rows[2 * i];
      const bf16* r1 = 2 * i + 1 < rank ? b_rows[2 * i + 1] : nullptr;
      __builtin_prefetch(r0 + o0 + kAhead, 0, 2);
      const __m512i v0 = _mm512_maskz_loadu_epi16(m, r0 + o0);
      __m512i v1 = _mm512_setzero_si512();
      if (r1) {
        __builtin_prefetch(r1 + o0 + kAhead, 0, 2);
        v1 = _mm512_maskz_loadu_epi16(m, r1 + o0);
      }
      const __m512bh p0 = (__m512bh)_mm512_unpacklo_epi16(v0, v1), p1 = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
      for (int k = 0; k < N; ++k) {
        const __m512bh hv = (__m512bh)_mm512_set1_epi32(static_cast<int>(hpair[k][i]));
        acc[k][0] = _mm512_dpbf16_ps(acc[k][0], hv, p0);
        acc[k][1] = _mm512_dpbf16_ps(acc[k][1], hv, p1);
      }
    }
    if (next) next->fetch(rank);
    const __mmask16 m0 = __mmask16(m), m1 = __mmask16(m >> 16);
    for (int k = 0; k < N; ++k) {
      _mm512_mask_storeu_ps(yout[k] + o0, m0, _mm512_permutex2var_ps(acc[k][0], kUnLo, acc[k][1]));
      if (m1) _mm512_mask_storeu_ps(yout[k] + o0 + 16, m1, _mm512_permutex2var_ps(acc[k][0], kUnHi, acc[k][1]));
    }
  }
}

// h[0 .. rank) -> bf16 pairs (nearest even), a zero after an odd rank.
inline void pair_bf16(const float* h, int64_t rank, uint32_t* out) {
  for (int64_t r = 0; r < rank; r += 32) {
    const __m512i v = round_bf16x32(h + r, std::min<int64_t>(32, rank - r));
    alignas(64) uint16_t tmp[32];
    _mm512_store_si512(tmp, v);
    const int64_t n = std::min<int64_t>(32, rank - r);
    for (int64_t i = 0; i < n; i += 2) out[(r + i) / 2] = tmp[i] | (uint32_t(i + 1 < n ? tmp[i + 1] : 0) << 16);
  }
}

// apply_items for bf16 pools with VDPBF16PS (xb: x rounded, rows padded to Dp).
void apply_items_dp(ffi::ThreadPool& pool, const std::vector<Item>& items, const bf16* xb, int64_t Dp,
                    int64_t D, const bf16* a, int64_t U, int64_t blocks, const bf16* const* b,
                    const int64_t* O, const Slots& sl, float* const* y) {
  const int64_t RT = blocks * sl.R;
  auto rows_of = [&](const Item& it, NextRows& out) { group_rows(it, a, D, U, blocks, b, O, sl, out); };
  items_fetching_ahead(pool, items, rows_of, [&](const Item& it, NextRows* next) {
    const int64_t rank = sl.rank(it.slot);
    std::vector<float> h(it.n * RT);
    std::vector<uint32_t> hp(it.n * ((rank + 1) / 2));
    float* hout[kRows];
    uint32_t* hpair[kRows];
    for (int64_t k = 0; k < it.n; ++k) hout[k] = h.data() + k * RT, hpair[k] = hp.data() + k * ((rank + 1) / 2);
    with_count(it.n, [&](auto n) {
      constexpr int N = decltype(n)::value;
      for (int64_t j = 0; j < blocks; ++j) {
        const SlotRows<bf16> rows(a + j * U * D, D, sl.rows, it.slot, sl.R, rank, U);
        for (int64_t r = 0; r < rank; ++r)
          shrink_row_dp<N>(it, xb, Dp, D, rows.rows[r], sl.scalings[it.slot], hout, j * sl.R + r, next);
      }
      for (int64_t j = 0; j < blocks; ++j) {
        const SlotRows<bf16> rows(b[j], O[j], sl.rows, it.slot, sl.R, rank, U);
        for (int k = 0; k < N; ++k) pair_bf16(hout[k] + j * sl.R, rank, hpair[k]);
        float* yout[kRows];
        token_rows(it, y[j], O[j], yout);
        expand_item_dp<N>(hpair, rank, rows.rows, O[j], yout, next);
      }
    });
  });
}
#endif  // AVX512-BF16

bool float_pool(const ffi::AnyBuffer& w) {
  return w.element_type() == ffi::DataType::F32 || w.element_type() == ffi::DataType::BF16;
}

// Zero the output rows of the tokens no item writes (base rows, out-of-range slots).
void zero_unwritten(const int32_t* slot_T, int64_t T, int64_t S, float* y, int64_t O) {
  for (int64_t t = 0; t < T; ++t)
    if (slot_T[t] <= 0 || slot_T[t] >= S) std::memset(y + t * O, 0, sizeof(float) * O);
}

ffi::Error Shrink(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x_TD, ffi::AnyBuffer a_LUD,
                  ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slot_T,
                  ffi::Buffer<ffi::F32> scalings_S, ffi::Buffer<ffi::S32> ranks_S,
                  ffi::Buffer<ffi::S32> rows_SR, ffi::ResultBuffer<ffi::F32> h_TR, int64_t blocks) {
  auto xd = x_TD.dimensions();
  auto ad = a_LUD.dimensions();
  auto rd = rows_SR.dimensions();
  if (!float_pool(a_LUD))
    return ffi::Error::InvalidArgument("multilora lora shrink: the pool must be float32 or bfloat16");
  if (xd.size() != 2 || ad.size() != 3 || rd.size() != 2 || ad[2] != xd[1] || blocks < 1 ||
      ad[1] % blocks || slot_T.element_count() != xd[0] || scalings_S.element_count() != rd[0] ||
      ranks_S.element_count() != rd[0])
    return ffi::Error::InvalidArgument("multilora lora shrink: operand shapes disagree");
  const int64_t T = xd[0], D = xd[1], L = ad[0], U = ad[1] / blocks, S = rd[0], R = rd[1];
  const int64_t offset = clamp_layer(layer.typed_data()[0], L) * ad[1] * D;
  const Slots sl{scalings_S.typed_data(), ranks_S.typed_data(), rows_SR.typed_data(), R};
  float* h = h_TR->typed_data();
  std::memset(h, 0, sizeof(float) * T * blocks * R);  // also the columns past each slot's rank
  const std::vector<Item> items = items_by_slot(slot_T.typed_data(), T, S);
  if (a_LUD.element_type() == ffi::DataType::F32)
    shrink_items(pool, items, x_TD.typed_data(), D, a_LUD.reinterpret_data<float>() + offset, U, blocks, sl, h);
  else
    shrink_items(pool, items, x_TD.typed_data(), D, a_LUD.reinterpret_data<bf16>() + offset, U, blocks, sl, h);
  return ffi::Error::Success();
}

ffi::Error Expand(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h_TR, ffi::AnyBuffer b_LUO,
                  ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slot_T,
                  ffi::Buffer<ffi::S32> ranks_S, ffi::Buffer<ffi::S32> rows_SR,
                  ffi::ResultBuffer<ffi::F32> y_TO) {
  auto hd = h_TR.dimensions();
  auto bd = b_LUO.dimensions();
  auto rd = rows_SR.dimensions();
  if (!float_pool(b_LUO))
    return ffi::Error::InvalidArgument("multilora lora expand: the pool must be float32 or bfloat16");
  if (hd.size() != 2 || bd.size() != 3 || rd.size() != 2 || rd[1] != hd[1] ||
      slot_T.element_count() != hd[0] || ranks_S.element_count() != rd[0])
    return ffi::Error::InvalidArgument("multilora lora expand: operand shapes disagree");
  const int64_t T = hd[0], R = hd[1], L = bd[0], U = bd[1], O = bd[2], S = rd[0];
  const int64_t offset = clamp_layer(layer.typed_data()[0], L) * U * O;
  const Slots sl{nullptr, ranks_S.typed_data(), rows_SR.typed_data(), R};
  float* y = y_TO->typed_data();
  zero_unwritten(slot_T.typed_data(), T, S, y, O);
  const std::vector<Item> items = items_by_slot(slot_T.typed_data(), T, S);
  if (b_LUO.element_type() == ffi::DataType::F32)
    expand_items(pool, items, h_TR.typed_data(), b_LUO.reinterpret_data<float>() + offset, U, O, sl, y);
  else
    expand_items(pool, items, h_TR.typed_data(), b_LUO.reinterpret_data<bf16>() + offset, U, O, sl, y);
  return ffi::Error::Success();
}

// y_j = expand_j(shrink(x)) for the blocks of a group (q/k/v, gate/up, or one projection): the
// A pool holds one block of U rows per B pool given.
ffi::Error Apply(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x_TD, ffi::Buffer<ffi::S32> layer,
                 ffi::Buffer<ffi::S32> slot_T, ffi::Buffer<ffi::F32> scalings_S,
                 ffi::Buffer<ffi::S32> ranks_S, ffi::Buffer<ffi::S32> rows_SR, ffi::AnyBuffer a_LUD,
                 ffi::RemainingArgs b_pools, ffi::RemainingRets ys, int64_t dot_bf16) {
  auto xd = x_TD.dimensions();
  auto ad = a_LUD.dimensions();
  auto rd = rows_SR.dimensions();
  const int64_t blocks = static_cast<int64_t>(b_pools.size());
  if (!float_pool(a_LUD))
    return ffi::Error::InvalidArgument("multilora lora apply: the pools must be float32 or bfloat16");
  if (xd.size() != 2 || ad.size() != 3 || rd.size() != 2 || ad[2] != xd[1] || blocks < 1 ||
      blocks > kMaxBlocks || static_cast<int64_t>(ys.size()) != blocks || ad[1] % blocks ||
      slot_T.element_count() != xd[0] || scalings_S.element_count() != rd[0] ||
      ranks_S.element_count() != rd[0])
    return ffi::Error::InvalidArgument("multilora lora apply: operand shapes disagree");
  const int64_t T = xd[0], D = xd[1], L = ad[0], U = ad[1] / blocks, S = rd[0], R = rd[1];
  const int64_t l = clamp_layer(layer.typed_data()[0], L);
  const void* b[kMaxBlocks];
  int64_t O[kMaxBlocks];
  float* y[kMaxBlocks];
  for (int64_t j = 0; j < blocks; ++j) {
    auto bj = b_pools.get<ffi::AnyBuffer>(j);
    auto yj = ys.get<ffi::Buffer<ffi::F32>>(j);
    if (bj.has_error() || yj.has_error())
      return ffi::Error::InvalidArgument("multilora lora apply: a B pool or result is not a buffer");
    auto bd = bj->dimensions();
    auto yd = (*yj)->dimensions();
    if (bj->element_type() != a_LUD.element_type() || bd.size() != 3 || bd[0] != L || bd[1] != U ||
        yd.size() != 2 || yd[0] != T || yd[1] != bd[2])
      return ffi::Error::InvalidArgument("multilora lora apply: a B pool disagrees with A or its result");
    O[j] = bd[2];
    b[j] = static_cast<const char*>(bj->untyped_data()) + l * U * O[j] * ffi::ByteWidth(bj->element_type());
    y[j] = (*yj)->typed_data();
    zero_unwritten(slot_T.typed_data(), T, S, y[j], O[j]);
  }
  const Slots sl{scalings_S.typed_data(), ranks_S.typed_data(), rows_SR.typed_data(), R};
  const std::vector<Item> items = items_by_slot(slot_T.typed_data(), T, S);
  const int64_t offset = l * ad[1] * D;
  if (a_LUD.element_type() == ffi::DataType::F32)
    apply_items(pool, items, x_TD.typed_data(), D, a_LUD.reinterpret_data<float>() + offset, U, blocks,
                reinterpret_cast<const float* const*>(b), O, sl, y);
  else if (dot_bf16) {
#ifdef MULTILORA_LORA_DP
    const int64_t Dp = (D + 31) / 32 * 32;
    std::vector<bf16> xb(items.empty() ? 0 : T * Dp);
    if (!items.empty()) round_rows(x_TD.typed_data(), T, D, Dp, xb.data());
    apply_items_dp(pool, items, xb.data(), Dp, D, a_LUD.reinterpret_data<bf16>() + offset, U, blocks,
                   reinterpret_cast<const bf16* const*>(b), O, sl, y);
#else
    return ffi::Error(ffi::ErrorCode::kUnimplemented, "multilora lora apply: built without AVX512-BF16");
#endif
  } else {
    apply_items(pool, items, x_TD.typed_data(), D, a_LUD.reinterpret_data<bf16>() + offset, U, blocks,
                reinterpret_cast<const bf16* const*>(b), O, sl, y);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiloraLoraShrink, Shrink,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
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
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiloraLoraApply, Apply,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("dot_bf16"));
