"""The device pool for adapters: rank rows, allocated at each adapter's true rank.

Every LoRA buffer is a pool of U rows per layer, one row per unit of rank, handed out in aligned
pages of PAGE_ROWS (8) rows (S-LoRA's unified paging): an adapter of rank r holds ceil(r / 8)
pages, anywhere in the pool, and a per-slot row table, rows_SR, says which rows (LoRABatchInfo
carries it to every backend). Page 0 is all zeros and never written with anything else: table
entries past a slot's pages, and the whole table of an empty slot, name its rows; an adapter's
rows past its rank inside its last page are written zero. So a rank-8 adapter beside a rank-128
one takes 8 rows, not 128, and the memory budget holds as many adapters as their true ranks
allow; max_lora_rank is only the table's width (the widest adapter accepted). Pages rather than
single rows so that a backend's gather moves 8-row slices (one run measured single-row gathers
1.46x slower on XLA's CPU backend; reruns were level: benchmarks/log/05-2026-12-02-pool-at-true-rank.md); the price is at most 7 rows
per adapter of a rank that is not a multiple of 8.

Stacked groups (q/k/v A, gate/up A) keep one block of U rows per projection: the stacked A is
(L, blocks * U, D) and block j of a slot's row r is row j * U + rows_SR[slot, r].

Writing an adapter scatters its rows into the pool in place (an update that the runner jits,
buffers donated, the rows traced), so shapes never change and nothing recompiles; clearing a slot
only resets its row table. Which adapter gets which slot and rows, and what to evict, is decided
in multilora.adapters.registry. Under tensor parallelism the pools are sharded by their declared axes
(LoRAWeights' fields, multilora.model.arrays: B by
output features where its base layer is column-parallel, A by input features where it is
row-parallel); a write takes the new rows already split the same way and keeps every pool's
sharding and layout (out_shardings).

Layout: every pool is kept rows-major (POOL_LAYOUT: a rank row's X features contiguous), the
layout every backend reads it in. A TPU's default layout for a pool is another (see POOL_LAYOUT),
and the compiled step then converted every pool whole, every step, before its layer loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout

from multilora import kernels
from multilora.config import PAGE_ROWS, LoRAConfig, ModelConfig, round_to_pages
from multilora.adapters.adapter import LoRAAdapter
from multilora.lora.backend import native_usable
from multilora.lora.batch import NO_ADAPTER, stacked_rows
from multilora.model.arrays import arrays, dim
from multilora.model.llama import LoRAWeights
from multilora.model.sharding import LORA_ROWS_RENAME, dataclass_shardings, put, replicated, rules_for

# Each pool as LoRAWeights declares it: axes, side (A or B) and the PEFT modules it holds.
POOLS = dict(arrays(LoRAWeights))


def blocks_of(field: str) -> int:
    """How many projections' blocks of rows a pool stacks (q/k/v A: 3, gate/up A: 2, else 1)."""
    return POOLS[field].blocks


def lora_feature_dims(cfg: ModelConfig) -> dict[str, int]:
    """Each pool's row width (the features a rank row spans: its last declared axis)."""
    return {k: dim(cfg, info.axes[-1]) for k, info in POOLS.items()}


def lora_buffer_shapes(cfg: ModelConfig, num_rows: int) -> dict[str, tuple[int, ...]]:
    """The pools' shapes for num_rows rows (the zero row included)."""
    return {k: (cfg.num_layers, blocks_of(k) * num_rows, x) for k, x in lora_feature_dims(cfg).items()}


def rank_row_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """Bytes of one rank row across every pool and layer: an adapter of rank r takes r of them."""
    return sum(blocks_of(k) * x for k, x in lora_feature_dims(cfg).items()) * cfg.num_layers * itemsize


# A pool (L, U, X) rows-major: layer, then row, then a row's features, the minor (contiguous) axis,
# as every backend reads it (pages of whole rows). The device's default layout is not always this:
# a TPU v5e lays bf16[30, 12336, 576] out {1,2,0}, rows minor (apparently the axis whose 128-wide
# tiles pad least), and each compiled step then converted every pool whole to rows-major before
# its layer loop, whether or not a row used an adapter (benchmarks/log/24-2026-12-05-tpu-v5e-rows-major.md: 1.4 GB a step at 257
# slots; a 512-token prefill with LoRA on and unused 1.73x of no LoRA, 1.17x with the pools made
# rows-major). Made rows-major and kept so by every write, the pools are read in place. The CPU's
# default is rows-major already: nothing changes there.
POOL_LAYOUT = Layout(major_to_minor=(0, 1, 2))


def pool_formats(shardings: LoRAWeights) -> LoRAWeights:
    """The pools' formats (POOL_LAYOUT on each pool's sharding): what they are made, written and
    compiled in."""
    return jax.tree.map(lambda s: Format(POOL_LAYOUT, s), shardings)


def rows_major(weights: LoRAWeights) -> LoRAWeights:
    """The same pools, each in POOL_LAYOUT on its own sharding (moved only where it is not)."""
    def one(a):
        if _is_rows_major(a):
            return a
        return jax.device_put(a, Format(POOL_LAYOUT, a.sharding))
    return jax.tree.map(one, weights)


def _is_rows_major(a: jax.Array) -> bool:
    layout = a.format.layout
    return layout is None or layout.major_to_minor == POOL_LAYOUT.major_to_minor  # None: no layouts here


def _zeros(shape, dtype, fmt: Format) -> jax.Array:
    """Zeros in fmt: made on the devices where that is their default layout, else from host zeros
    shard by shard (never a second whole pool on a device)."""
    a = jnp.zeros(shape, dtype, device=fmt.sharding)
    if _is_rows_major(a):
        return a
    del a  # freed before the pool is made again
    return jax.make_array_from_callback(
        shape, fmt, lambda index: np.zeros([len(range(*i.indices(n))) for i, n in zip(index, shape)], dtype))


def init_lora_weights(cfg: ModelConfig, lora_cfg: LoRAConfig, dtype, mesh) -> LoRAWeights:
    shapes = lora_buffer_shapes(cfg, lora_cfg.num_rows)
    formats = pool_formats(lora_shardings(cfg, mesh))
    # Created in place, shard by shard: no device ever holds a whole (possibly large) buffer.
    return LoRAWeights(**{k: _zeros(shape, dtype, getattr(formats, k)) for k, shape in shapes.items()})


def lora_shardings(cfg: ModelConfig, mesh, rename=None) -> LoRAWeights:
    """A LoRAWeights of NamedShardings (per the rules table) for the pools, or for one adapter's
    rows with rename=LORA_ROWS_RENAME."""
    host = LoRAWeights(**{k: np.zeros((), np.float32) for k in POOLS})
    return dataclass_shardings(host, mesh, rules_for(cfg, mesh), rename)


def adapter_slot_arrays(adapter: LoRAAdapter | None, cfg: ModelConfig, max_rank: int) -> LoRAWeights:
    """One adapter's rows (host, (L, blocks * max_rank, X), in its host copy's dtype: the pool's),
    laid out like LoRAWeights: rows past a module's rank and every untargeted module stay zero."""
    dtype = next((a.dtype for a, _ in adapter.modules.values()), np.float32) if adapter is not None else np.float32
    out = {k: np.zeros((cfg.num_layers, blocks_of(k) * max_rank, x), dtype)
           for k, x in lora_feature_dims(cfg).items()}
    if adapter is None:
        return LoRAWeights(**out)
    R = max_rank
    for field, info in POOLS.items():
        for block, module in enumerate(info.modules):
            if module not in adapter.modules:
                continue
            a_LRI, b_LOR = adapter.modules[module]
            if info.side == "a":
                out[field][:, block * R:block * R + a_LRI.shape[1]] = a_LRI
            else:  # PEFT's B is (out, rank); the pools keep (rank, out)
                out[field][:, :b_LOR.shape[2], :] = b_LOR.transpose(0, 2, 1)
    return LoRAWeights(**out)


def write_widths(table_width: int) -> tuple[int, ...]:
    """The row counts a slot write is compiled for: whole pages, doubling from one page, and the
    table's width. An adapter is written at the least of them that holds its rank
    (write_width), so that its write, and the layout a loader thread prepares for it, track its
    true rank: written at the table's width, a rank-16 adapter beside a rank-128 one laid out and
    scattered 128 rows a layer, 112 of them zeros (10 ms of the engine thread against 2.1-3.3 at
    its own width; benchmarks/log/26-2026-12-05-adapter-reads-native-pass.md)."""
    widths, w = [], PAGE_ROWS
    while w < table_width:
        widths.append(w)
        w *= 2
    return tuple(widths) + (table_width,)


def write_width(rank: int, table_width: int) -> int:
    """The rows an adapter of `rank` is laid out and written with (write_widths)."""
    n = round_to_pages(rank)
    if n > table_width:
        raise ValueError(f"rank {rank} needs {n} rows, more than the table's {table_width}")
    return next(w for w in write_widths(table_width) if w >= n)


def prepare_slot_layout(adapter: LoRAAdapter, cfg: ModelConfig, table_width: int) -> None:
    """Lay out the adapter's rows for a slot write now (adapter_slot_arrays, at its write_width),
    kept on the adapter until LoRASlots.load takes them: for the loader's threads, so that the
    engine's thread, which writes between steps while every stream waits, only copies them into
    the pool (4-7 ms of the 7-12 ms a rank-16 SmolLM2 adapter's write took there). Taken once: a
    later write of the same host copy lays it out again, so that copies kept in the host tier
    hold their modules only."""
    width = write_width(adapter.rank, table_width)
    adapter.slot_layout = (width, adapter_slot_arrays(adapter, cfg, width))


def take_slot_layout(adapter: LoRAAdapter, cfg: ModelConfig, width: int) -> LoRAWeights:
    """The adapter's slot layout at `width` rows: the one prepare_slot_layout left (dropped from
    the adapter), or laid out now."""
    ready, adapter.slot_layout = adapter.slot_layout, None
    if ready is not None and ready[0] == width:
        return ready[1]
    return adapter_slot_arrays(adapter, cfg, width)


def page_rows(pages) -> list[int]:
    """The rows of these pages, in order."""
    return [p * PAGE_ROWS + i for p in pages for i in range(PAGE_ROWS)]


def empty_table_row(width: int) -> np.ndarray:
    """A slot's table with no adapter: every page names the zero page."""
    return np.arange(width, dtype=np.int32) % PAGE_ROWS


def write_rows(lora: LoRAWeights, rows_R: jax.Array, new: LoRAWeights, native: bool = False) -> LoRAWeights:
    """Pure: lora with the rows rows_R (R,) of every pool replaced by `new`'s (jitted with
    donation in the runner). Entries past the adapter's pages name the zero page, and `new` is
    zero there (and past its rank), so the zero page stays zero. native: through multilora's
    pool kernel (one CPU device), which writes the rows in place in the donated pool."""
    def one(field):
        buf, x = getattr(lora, field), getattr(new, field)
        if buf.size == 0:  # the experts' pools of a model without experts
            return buf
        b = blocks_of(field)
        idx = stacked_rows(rows_R, b, buf.shape[1] // b)
        if native:
            return kernels.pool_write(buf, idx, x)
        if buf.dtype == jnp.bfloat16:
            # By the bits: XLA's CPU backend runs a bfloat16 scatter in float32, converting the
            # whole pool both ways on every write (seconds per adapter for a 2 GB pool); the
            # bitcasts still cost whole-pool copies (pool_kernels.cc), hence `native` where it can.
            bits = jax.lax.bitcast_convert_type(buf, jnp.uint16)
            new_bits = jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
            bits = bits.at[:, idx].set(new_bits, mode="promise_in_bounds", unique_indices=False)
            return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
        return buf.at[:, idx].set(x.astype(buf.dtype), mode="promise_in_bounds",
                                  unique_indices=False)
    return LoRAWeights(**{f: one(f) for f in POOLS})


class LoRASlots:
    """The device pools plus each slot's scaling, rank and row table (host arrays fed to every
    batch)."""

    def __init__(self, cfg: ModelConfig, lora_cfg: LoRAConfig, dtype, mesh, jit_writer=None,
                 native_write: bool = True):
        """jit_writer: the runner's jit_slot_writer (jit lives in the runner; it is handed in so
        that this module does not import the runner). Without it rows are written eagerly.
        native_write=False: XLA's writer even where multilora's pool kernel could write."""
        self.cfg, self.lora_cfg = cfg, lora_cfg
        self.shardings = lora_shardings(cfg, mesh)
        self.formats = pool_formats(self.shardings)
        self.weights = init_lora_weights(cfg, lora_cfg, dtype, mesh)
        self._rows_shardings = lora_shardings(cfg, mesh, LORA_ROWS_RENAME)
        # multilora's pool kernel where it can write these pools (one CPU device, kernels built)
        self.native_write = native_write and native_usable(dtype, self.weights.qkv_a_LUD.sharding.device_set)
        writer = functools.partial(write_rows, native=self.native_write)
        # One compiled writer per write width (an adapter is written at its own rank's width,
        # write_width); eagerly, a write's result takes the device's default layout: put back
        # rows-major.
        if jit_writer is not None:
            writers = {w: jit_writer(writer, self.weights, self.formats, self._rows_shardings, replicated(mesh), w)
                       for w in write_widths(lora_cfg.table_width)}
            self._write = lambda weights, rows_W, new: writers[len(rows_W)](weights, rows_W, new)
        else:
            self._write = lambda *a: rows_major(writer(*a))
        S, R = lora_cfg.num_slots, lora_cfg.table_width
        self.scalings_S = np.zeros((S,), np.float32)
        self.ranks_S = np.zeros((S,), np.int32)
        self.rows_SR = np.tile(empty_table_row(R), (S, 1))

    def release(self) -> None:
        """Let go of the pools and their compiled writers (the engine's shutdown)."""
        self.weights = self._write = None

    @property
    def num_slots(self) -> int:
        return self.lora_cfg.num_slots

    def _check(self, slot: int):
        if not (NO_ADAPTER < slot < self.num_slots):
            raise ValueError(f"slot {slot} out of range: adapter slots are 1..{self.num_slots - 1} "
                             f"(slot {NO_ADAPTER} is the base model)")

    def load(self, slot: int, rows, adapter: LoRAAdapter) -> None:
        """Write `adapter` into the pool rows `rows` (the rows of its pages: page_rows) and point
        `slot`'s table at them."""
        self._check(slot)
        R = self.lora_cfg.table_width
        if adapter.rank > self.lora_cfg.max_lora_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank} > max_lora_rank "
                             f"{self.lora_cfg.max_lora_rank}")
        rows = np.asarray(rows, np.int32)
        n = round_to_pages(adapter.rank)
        pages = rows.ravel()[::PAGE_ROWS] // PAGE_ROWS
        if rows.shape != (n,) or rows.tolist() != page_rows(pages.tolist()) or np.any(pages < 1) \
                or np.any(rows >= self.lora_cfg.num_rows) or len(set(pages.tolist())) != len(pages):
            raise ValueError(f"adapter {adapter.name!r} of rank {adapter.rank} needs the rows of {n // PAGE_ROWS} "
                             f"distinct pages of {PAGE_ROWS} in 1..{self.lora_cfg.num_rows // PAGE_ROWS - 1}, "
                             f"got {rows.tolist()}")
        rows_R = empty_table_row(R)
        rows_R[:n] = rows
        width = write_width(adapter.rank, R)  # its rows and zero-page entries up to its width only
        new = take_slot_layout(adapter, self.cfg, width)
        pool_dtype = self.weights.qkv_a_LUD.dtype
        if any(x.dtype != pool_dtype for x in jax.tree.leaves(new)):  # a host copy read for another pool dtype
            new = jax.tree.map(lambda x: np.asarray(x, np.float32).astype(pool_dtype), new)
        self.weights = self._write(self.weights, rows_R[:width], jax.tree.map(put, new, self._rows_shardings))
        self.rows_SR[slot] = rows_R
        self.scalings_S[slot] = adapter.scaling
        self.ranks_S[slot] = adapter.rank

    def clear(self, slot: int) -> None:
        """The slot reads the zero row again (its rows go back to the registry's free list; their
        contents are overwritten whole by the next adapter that gets them)."""
        self._check(slot)
        self.rows_SR[slot] = empty_table_row(self.lora_cfg.table_width)
        self.scalings_S[slot] = 0.0
        self.ranks_S[slot] = 0


# ---- slot-major arrays (one (R, X) block per slot) as a pool: for scripts and benchmarks -------

def slot_major_rows(num_slots: int, rank: int) -> np.ndarray:
    """The row table of slot_major_pool: slot s at rows s * R .. s * R + R - 1 (slot 0, all
    zeros, is the zero page when R is whole pages)."""
    return np.arange(num_slots * rank, dtype=np.int32).reshape(num_slots, rank)


def slot_major_pool(w_SRX, blocks: int = 1):
    """Slot-major weights (S, blocks * R, X), slot 0 all zeros, -> a pool (blocks * S * R, X) read
    through slot_major_rows (R a multiple of PAGE_ROWS: slot 0 holds the zero page). numpy or jax
    arrays alike."""
    s, br, x = w_SRX.shape
    r = br // blocks
    xp = np if isinstance(w_SRX, np.ndarray) else jnp
    return xp.concatenate([w_SRX[:, j * r:(j + 1) * r].reshape(s * r, x) for j in range(blocks)], axis=0)
