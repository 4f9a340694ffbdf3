"""multilora's one-read safetensors views against the safetensors library (the reference), and
every malformed file refused with a ValueError that says what is wrong."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from safetensors.torch import load_file as torch_load_file
from safetensors.torch import save_file as torch_save_file

from multilora.adapters.safetensors_views import Scratch, read_header, read_views


def _tensors():
    rng = np.random.default_rng(0)
    return {"a.lora_A.weight": rng.standard_normal((8, 64)).astype(np.float32),
            "a.lora_B.weight": rng.standard_normal((32, 8)).astype(np.float16),
            "b.weight": rng.standard_normal((3,)).astype(np.float64),
            "empty": np.zeros((0, 5), np.float32),
            "scalar": np.full((), 2.5, np.float32)}


def test_a_reused_scratch_reads_the_same_and_never_overwrites_live_views(tmp_path):
    """Reads into a reused buffer equal plain reads; while the last read's views are alive the
    next read takes a new buffer (those views keep their values), and once they are dropped the
    buffer is reused. A larger file grows it; a truncated one is still refused."""
    scratch = Scratch()
    first, second = tmp_path / "1.safetensors", tmp_path / "2.safetensors"
    want = _tensors()
    save_file(want, first)
    other = {k: np.asarray(v + 1, v.dtype) for k, v in want.items()}
    other["big"] = np.arange(10_000, dtype=np.float32)
    save_file(other, second)
    got = read_views(second, scratch)        # the larger file first: the buffer fits both
    for k, v in other.items():
        np.testing.assert_array_equal(got[k], v)
        assert not got[k].flags.writeable
    got2 = read_views(first, scratch)        # `got` is alive: a new buffer, `got` unchanged
    for k, v in other.items():
        np.testing.assert_array_equal(got[k], v)
    for k, v in want.items():
        np.testing.assert_array_equal(got2[k], v)
    del got, got2
    buf = scratch.take(1)
    reused = buf.obj
    del buf
    got3 = read_views(first, scratch)        # nothing alive: the same buffer again
    assert np.shares_memory(got3["a.lora_A.weight"], np.frombuffer(reused, np.uint8))
    del got3
    path = tmp_path / "cut.safetensors"
    path.write_bytes(first.read_bytes()[:-4])
    with pytest.raises(ValueError):
        read_views(path, scratch)


def test_views_equal_the_library_read(tmp_path):
    path = tmp_path / "t.safetensors"
    want = _tensors()
    save_file(want, path, metadata={"format": "pt"})
    got = read_views(path)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        np.testing.assert_array_equal(got[k], v)
        assert not got[k].flags.writeable  # views of the one read buffer
    assert read_header(path) == {k: (str(v.dtype), v.shape) for k, v in want.items()}


def test_bfloat16_views_equal_torch(tmp_path):
    path = tmp_path / "bf16.safetensors"
    g = torch.Generator().manual_seed(0)
    torch_save_file({"w": torch.randn(16, 48, generator=g, dtype=torch.float32).to(torch.bfloat16)}, path)
    got = read_views(path)["w"]
    assert str(got.dtype) == "bfloat16" and got.shape == (16, 48)
    np.testing.assert_array_equal(got.astype(np.float32), torch_load_file(path)["w"].float().numpy())


def _file(header: dict, data: bytes = b"", n: int | None = None) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h) if n is None else n) + h + data


GOOD = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
BAD = {
    "too_short": (b"\x01\x02", "too short"),
    "header_past_end": (_file(GOOD, bytes(16), n=10_000), "header length 10000 does not fit"),
    "header_not_json": (struct.pack("<Q", 4) + b"{{{{" + bytes(16), "header is not JSON"),
    "header_not_object": (_file([1, 2]), "not a JSON object"),
    "entry_not_object": (_file({"w": 3}), "header entry is not an object"),
    "integer_dtype": (_file({"w": {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]}}, bytes(2)),
                      "dtype 'I8' is not one of F64, F32, F16, BF16"),
    "bad_shape": (_file({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4)),
                  "is not a list of sizes"),
    "truncated_data": (_file(GOOD, bytes(8)), "outside the file's 8 data bytes"),
    "reversed_offsets": (_file({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}}, bytes(8)),
                         "data_offsets [8, 4] are outside"),
    "bytes_do_not_match_shape": (_file({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}},
                                       bytes(16)), "16 bytes do not hold float32 (3,)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_files_are_refused_by_both_reads(case, tmp_path):
    data, words = BAD[case]
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(data)
    for read in (read_views, read_header):
        with pytest.raises(ValueError) as e:
            read(path)
        assert words in str(e.value), (case, read.__name__, str(e.value))


def test_a_well_formed_handmade_file_reads(tmp_path):
    path = tmp_path / "ok.safetensors"
    path.write_bytes(_file(GOOD, np.arange(4, dtype="<f4").tobytes()))
    np.testing.assert_array_equal(read_views(path)["w"], [[0, 1], [2, 3]])
