"""A step's batch in one buffer (multilora.model.packing): packed on the host, taken apart inside
jit, every leaf back bit for bit; what it refuses."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from multilora.engine.batching import SeqChunk, build_batch
from multilora.lora.backend import get_backend
from multilora.model.packing import pack, unpack


def _batch(num_tokens=64, slots=5):
    scal = np.array([0.0, 2.0, -0.0, np.nan, 0.5][:slots], np.float32)  # -0.0 and NaN must keep their bits
    ranks = np.array([0, 16, 8, 16, 8][:slots], np.int32)
    rows = np.arange(slots * 16, dtype=np.int32).reshape(slots, 16)
    prepare = lambda slot_T: get_backend("sgmv").prepare_lora_batch(slot_T, scal, ranks, rows, 8)  # noqa: E731
    chunks = [SeqChunk([5], 9, [3], 1), SeqChunk([7], 20, [4, 6], 3), SeqChunk(list(range(11, 30)), 0, [2, 7], 4)]
    return build_batch(chunks, num_tokens=num_tokens, num_pages=16, num_logits=8, page_size=16,
                       prepare_lora=prepare)


def test_a_packed_batch_comes_back_bit_for_bit_inside_jit():
    batch = _batch()
    spec, buf = pack(batch)
    assert buf.dtype == np.int32 and buf.ndim == 1
    out = jax.jit(unpack, static_argnums=0)(spec, buf)
    want, got = jax.tree.leaves(batch), jax.tree.leaves(out)
    assert len(want) == len(got) == len(spec.leaves) > 10
    for w, g in zip(want, got):
        w = np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype
        assert np.asarray(g).tobytes() == w.tobytes()  # exact, NaN and -0.0 included
    assert jax.tree.structure(out) == jax.tree.structure(batch)


def test_the_spec_is_the_bucket_not_the_values():
    a, _ = pack(_batch())
    b, _ = pack(dataclasses.replace(_batch(), token_ids_T=np.full(64, 3, np.int32)))
    assert a == b and hash(a) == hash(b)  # one compiled step per bucket
    c, _ = pack(_batch(num_tokens=128))
    assert c != a


@pytest.mark.parametrize("bad", [np.zeros(3, np.int64), np.zeros(3, bool), np.zeros(3, np.float16)])
def test_other_dtypes_are_refused_by_name(bad):
    with pytest.raises(TypeError, match=f"4-byte dtypes .*not {bad.dtype}"):
        pack({"ok": np.zeros(2, np.int32), "bad": bad})
