"""The Pallas paged attention (multilora.kernels.attention_pallas) against XLA's decode and
prefill attention over the same heads-major cache (multilora.model.attention, the CPU's path),
and against a plain all-keys reference: decode rows and prefill chunks in one step, pages out
of order and interleaved between sequences, block tables longer than needed, padding tokens and
pages, GQA, sliding windows, several query blocks. On the CPU (CI) the kernel runs in Pallas's
TPU interpreter; on a TPU the same tests run it compiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multilora.kernels.attention_pallas import paged_attention, paged_attention_reference
from multilora.model.attention import decode_attention, prefill_attention
from tests.test_attention import _decode_case

ON_TPU = jax.default_backend() == "tpu"
RUN = jax.jit(paged_attention, static_argnames=("sliding_window", "interpret", "block_rows", "chunk_keys", "scale"))


# decode_pos: each decode sequence's position; prefill: (length, start) chunks.
ATTENTION_CASES = [
    ([0, 15, 16, 36, 4], [(9, 0), (6, 11)], 16, 32, 32, 4, 2, None, None),
    ([0, 15, 16, 36, 4], [(9, 0), (6, 11)], 16, 32, 32, 4, 2, 6, 16),
    ([11, 3, 0, 22, 49, 80, 5, 2, 9, 1, 33, 17, 4], [(40, 2)], 16, 96, 64, 6, 2, 20, 16),
    ([63, 0, 31, 7], [], 16, 16, 16, 4, 1, None, None),                 # decode only, padding pages
    ([], [(70, 0), (45, 30)], 16, 128, 16, 9, 3, None, None),           # prefill only, two 64-row blocks
    ([7, 12, 5, 9, 3, 11, 8, 6], [], 4, 64, 32, 4, 2, None, None),       # page size 4: chunks of 32 pages
    ([100, 130, 5], [(40, 200)], 128, 64, 8, 4, 2, None, None),          # a TPU's default page: 2 a chunk
]
# bfloat16 (rows in (16, 128) tiles) on a TPU every case; in the CPU's interpreter (~10 s a case)
# those whose rows meet the tiles in other ways: a window with 16-row blocks, pages of 4 and of 128
BF16_CASES = ATTENTION_CASES if ON_TPU else [ATTENTION_CASES[i] for i in (2, 5, 6)]


@pytest.mark.parametrize("decode_pos,prefill,page_size,num_tokens,num_pages,n,kvh,window,block_rows,dtype",
                         [c + ("float32",) for c in map(tuple, ATTENTION_CASES)]
                         + [c + ("bfloat16",) for c in map(tuple, BF16_CASES)])
def test_paged_attention_matches_xla_and_the_reference(decode_pos, prefill, page_size, num_tokens, num_pages,
                                                       n, kvh, window, block_rows, dtype):
    rng = np.random.default_rng(len(decode_pos) * 31 + num_tokens)
    h = 64
    q, k, v, b, _ = _decode_case(rng, decode_pos, prefill, page_size, num_tokens, num_pages, n, kvh, h)
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    k_hm, v_hm = jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3)   # (L, P, K, p, H): heads-major's order
    layer = 1
    # float32 in chunks of 256 keys (several a block: the double buffer's turns), bfloat16 at the default
    got = RUN(q, k_hm, v_hm, jnp.int32(layer), b.kv_pages_X, b.kv_page_seq_X, b.seq_idx_T, b.positions_T,
              sliding_window=window, interpret=not ON_TPU, block_rows=block_rows,
              chunk_keys=256 if dtype == "float32" else None)
    got = np.asarray(got.astype(jnp.float32))
    ref = np.asarray(paged_attention_reference(q, k_hm, v_hm, layer, b.kv_pages_X, b.kv_page_seq_X, b.seq_idx_T,
                                               b.positions_T, window).astype(jnp.float32))
    is_dec = (np.asarray(b.seq_idx_T) >= 0) & (np.asarray(b.seq_idx_T) < int(b.num_decode))
    pre_seq = jnp.where(is_dec, -1, b.seq_idx_T)
    dec = decode_attention(q, k_hm, v_hm, layer, b.kv_pages_X, b.kv_page_seq_X, b.positions_T, b.num_decode,
                           window, False, True)
    pre = prefill_attention(q, k_hm, v_hm, layer, b.kv_pages_X, b.kv_page_seq_X, pre_seq, b.positions_T,
                            window, False, True)
    xla = np.asarray(jnp.where(is_dec[:, None, None], dec, pre).astype(jnp.float32))
    tol = 3e-2 if dtype == "bfloat16" else (2e-3 if ON_TPU else 2e-5)
    padding = np.asarray(b.seq_idx_T) < 0
    assert np.all(got[padding] == 0.0), "padding tokens got attention"
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=tol, rtol=tol)
    np.testing.assert_allclose(got, xla, atol=tol, rtol=tol)


# (case, head dim, dtype): kv heads packed f = 128 // H a row (multilora.model.kv_lanes): 2 heads
# of 64 in one group; 3 heads of 64 in two groups (one zero head); 2 heads of 32 in a group of 4
PACKED_CASES = [(0, 64, "float32"), (4, 64, "float32"), (2, 32, "bfloat16")]


@pytest.mark.parametrize("case,h,dtype", PACKED_CASES)
def test_paged_attention_over_lane_packed_pages_matches_the_reference(case, h, dtype):
    """The same kernel over a cache whose rows hold f kv heads side by side: packed queries in,
    each head's output unpacked, against the reference over the unpacked cache."""
    from multilora.model import kv_lanes
    decode_pos, prefill, page_size, num_tokens, num_pages, n, kvh, window, block_rows = ATTENTION_CASES[case]
    rng = np.random.default_rng(len(decode_pos) * 31 + num_tokens)   # as the unpacked test: the same step
    q, k, v, b, _ = _decode_case(rng, decode_pos, prefill, page_size, num_tokens, num_pages, n, kvh, h)
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    f = kv_lanes.lane_pack(h)
    packed = []
    for c in (k, v):   # (L, P, p, K, H) -> (L, P, Kg, p, f * H), heads-major's order
        rows = kv_lanes.pack_rows(c.reshape(-1, kvh, h), f)
        packed.append(jnp.swapaxes(rows.reshape(c.shape[:3] + rows.shape[1:]), 2, 3))
    assert packed[0].shape[-1] == 128 and packed[0].shape[2] == -(-kvh // f)
    layer = 1
    out = RUN(kv_lanes.pack_queries(q, kvh, f), *packed, jnp.int32(layer), b.kv_pages_X, b.kv_page_seq_X,
              b.seq_idx_T, b.positions_T, sliding_window=window, interpret=not ON_TPU, block_rows=block_rows,
              scale=h ** -0.5)
    got = np.asarray(kv_lanes.unpack_outputs(out, kvh, n, f).astype(jnp.float32))
    k_hm, v_hm = jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3)
    ref = np.asarray(paged_attention_reference(q, k_hm, v_hm, layer, b.kv_pages_X, b.kv_page_seq_X, b.seq_idx_T,
                                               b.positions_T, window).astype(jnp.float32))
    tol = 3e-2 if dtype == "bfloat16" else (2e-3 if ON_TPU else 2e-5)
    assert got.shape == ref.shape and np.isfinite(got).all()
    assert np.all(got[np.asarray(b.seq_idx_T) < 0] == 0.0), "padding tokens got attention"
    np.testing.assert_allclose(got, ref, atol=tol, rtol=tol)


def test_lane_packing_round_trips_and_is_refused_where_it_cannot_be_read(monkeypatch):
    """pack_queries / unpack_outputs invert each other (exactly: products with 0 and 1); the
    engine's pack factor (on by default, knob unset or empty) is 1 off a TPU, without the Pallas
    attention, or with the knob at 0, and a bad knob value is refused naming it."""
    from multilora.model import kv_lanes
    q = jnp.asarray(np.random.default_rng(0).standard_normal((5, 9, 64)), jnp.bfloat16)
    for f in (1, 2):
        assert np.array_equal(np.asarray(kv_lanes.unpack_outputs(kv_lanes.pack_queries(q, 3, f), 3, 9, f)),
                              np.asarray(q))
    assert kv_lanes.pack_queries(q, 3, 2).shape == (5, 2 * 2 * 3, 128)
    assert kv_lanes.lane_pack(64) == 2 and kv_lanes.lane_pack(32) == 4 and kv_lanes.lane_pack(128) == 1
    assert kv_lanes.lane_pack(96) == 1 and kv_lanes.lane_pack(256) == 1
    monkeypatch.delenv("MULTILORA_PALLAS_ATTENTION", raising=False)
    for on in (None, "", "1"):
        if on is None:
            monkeypatch.delenv(kv_lanes.ENV, raising=False)
        else:
            monkeypatch.setenv(kv_lanes.ENV, on)
        assert kv_lanes.lane_pack_on(64, "tpu") == 2 and kv_lanes.lane_pack_on(64, "cpu") == 1
        assert kv_lanes.lane_pack_on(64, "tpu", tensor_parallel=2) == 1 and kv_lanes.lane_pack_on(128, "tpu") == 1
        monkeypatch.setenv("MULTILORA_PALLAS_ATTENTION", "0")
        assert kv_lanes.lane_pack_on(64, "tpu") == 1
        monkeypatch.delenv("MULTILORA_PALLAS_ATTENTION")
    monkeypatch.setenv(kv_lanes.ENV, "0")
    assert kv_lanes.lane_pack_on(64, "tpu") == 1
    monkeypatch.setenv(kv_lanes.ENV, "yes")
    with pytest.raises(ValueError, match=r"MULTILORA_KV_LANE_PACK='yes': expected 0 or 1"):
        kv_lanes.lane_pack_on(64, "tpu")


def test_an_engine_packs_its_cache_only_where_the_pallas_attention_reads_it(monkeypatch, caplog):
    """build.kv_layout: heads-major on a TPU, lane-packed there (unless asked not to) where
    H < 128 and the model is not soft-capped (its steps take XLA's attention); its pages then count at true size."""
    from multilora.config import EngineConfig, ModelConfig
    from multilora.engine.build import kv_cache_pages, kv_layout
    from tests import reference
    cfg = ModelConfig.from_hf_dict(reference.TINY_CONFIGS["qwen3"])          # 2 kv heads of 32
    capped = ModelConfig.from_hf_dict(reference.TINY_CONFIGS["gemma2"])
    c = EngineConfig(kv_cache_memory_gb=1 / 1024, max_num_seqs=1000)   # 1 MiB: 32 pages unpacked
    monkeypatch.delenv("MULTILORA_KV_LANE_PACK", raising=False)
    monkeypatch.delenv("MULTILORA_PALLAS_ATTENTION", raising=False)
    assert kv_layout(cfg, c, "tpu") == (True, 4) and kv_layout(cfg, c, "cpu") == (False, 1)
    assert kv_layout(capped, c, "tpu") == (True, 1)
    with caplog.at_level("INFO", logger="multilora.engine"):
        assert kv_cache_pages(cfg, c, 256, jnp.bfloat16, True, 4) == 2 * kv_cache_pages(cfg, c, 256, jnp.bfloat16, True)
    assert "KV cache: 64 pages of 16 tokens (1008 tokens besides the reserved page, 1.0 MB; heads-major, " \
        "4 kv heads a row)" in caplog.text   # what a user sees at start
    monkeypatch.setenv("MULTILORA_KV_LANE_PACK", "0")
    assert kv_layout(cfg, c, "tpu") == (True, 1)


def test_block_size_knobs_take_positive_integers_and_name_a_bad_value(monkeypatch):
    """The Pallas kernels' measurement knobs: unset, empty or 0 leave the kernel's own choice; a
    positive integer forces it; anything else is refused naming the variable and what is allowed."""
    from multilora.kernels.attention_pallas import KEYS_PER_CHUNK, keys_per_chunk, query_block
    from multilora.kernels.lora_pallas import CHUNK_ENV, chunk_adapters
    for value in (None, "", "0"):
        for name in ("MULTILORA_PALLAS_QUERY_BLOCK", "MULTILORA_PALLAS_CHUNK_KEYS", CHUNK_ENV):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        assert query_block(64) == 16 and query_block(512) == 64
        assert keys_per_chunk(64) == KEYS_PER_CHUNK
        assert chunk_adapters(32) == 4
    monkeypatch.setenv("MULTILORA_PALLAS_QUERY_BLOCK", "8")
    monkeypatch.setenv("MULTILORA_PALLAS_CHUNK_KEYS", "512")
    monkeypatch.setenv(CHUNK_ENV, "2")
    assert query_block(64) == 8 and keys_per_chunk(64) == 512 and chunk_adapters(32) == 2
    for bad in ("-4", "1.5", "sixteen"):
        monkeypatch.setenv("MULTILORA_PALLAS_CHUNK_KEYS", bad)
        with pytest.raises(ValueError, match=r"\$MULTILORA_PALLAS_CHUNK_KEYS=.*positive integer"):
            keys_per_chunk(64)


def test_chunk_pages_fit_the_vmem_budget_and_the_step():
    """A chunk holds KEYS_PER_CHUNK keys unless both buffers of its K and V pages would pass
    CHUNK_BUFFER_BYTES (a page's H padded to 128 lanes), never more pages than the step has, never none."""
    from multilora.kernels.attention_pallas import CHUNK_BUFFER_BYTES, KEYS_PER_CHUNK, chunk_pages, page_vmem_bytes
    assert page_vmem_bytes(8, 16, 64, jnp.bfloat16) == 8 * 16 * 128 * 2      # H = 64 takes 128 lanes
    assert page_vmem_bytes(8, 16, 128, jnp.float32) == 8 * 16 * 128 * 4
    small = page_vmem_bytes(8, 16, 64, jnp.bfloat16)
    assert chunk_pages(1000, 16, small) == KEYS_PER_CHUNK // 16
    wide = page_vmem_bytes(32, 16, 128, jnp.bfloat16)                        # 32 kv heads of 128
    c = chunk_pages(1000, 16, wide)
    assert c < KEYS_PER_CHUNK // 16 and 4 * c * wide <= CHUNK_BUFFER_BYTES < 4 * (c + 1) * wide
    assert chunk_pages(5, 16, small) == 5 and chunk_pages(1000, 16, 10 * CHUNK_BUFFER_BYTES) == 1


def test_keys_per_chunk_keep_a_kv_heads_score_tile_bounded(monkeypatch):
    """Decode blocks (G x 16 rows, G up to 8: kv heads two to a row double G) score
    KEYS_PER_CHUNK keys a chunk, prefill's 64-row blocks fewer: halved while rows x keys passes
    SCORE_TILE (DECODE_SCORE_TILE for blocks of at most 16 rows), never below 128."""
    from multilora.kernels.attention_pallas import DECODE_SCORE_TILE, KEYS_PER_CHUNK, SCORE_TILE, keys_per_chunk
    monkeypatch.delenv("MULTILORA_PALLAS_CHUNK_KEYS", raising=False)
    assert keys_per_chunk(4 * 16, 16) == KEYS_PER_CHUNK == 1024 and keys_per_chunk(3 * 16, 16) == 1024
    assert keys_per_chunk(2 * 4 * 16, 16) == 1024 and keys_per_chunk(16 * 16, 16) == 512
    assert keys_per_chunk(4 * 64) == 256 and keys_per_chunk(3 * 64) == 256 and keys_per_chunk(10 ** 6) == 128
    assert keys_per_chunk(2 * 4 * 64, 64) == 128 and keys_per_chunk(2 * 3 * 64, 64) == 128
    for block_rows, tile in ((8, DECODE_SCORE_TILE), (16, DECODE_SCORE_TILE), (32, SCORE_TILE), (64, SCORE_TILE)):
        for rows in range(1, 2000, 7):
            keys = keys_per_chunk(rows, block_rows)
            assert keys * rows <= tile or keys == 128
            assert keys == KEYS_PER_CHUNK or 2 * keys * rows > tile