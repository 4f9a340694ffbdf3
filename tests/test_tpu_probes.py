"""The TPU probes (benchmarks/dma_overlap_probe.py, lora_kernel_probe.py) and tpu_steps.sh kept
working without a chip: each probe's --quick run in Pallas's interpreter, the overlap probe's
kernel against its plain-jnp reference (and a wrong reference caught), the script's syntax."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_overlap_probe_quick_checks_its_kernel(capsys, tmp_path):
    from benchmarks import dma_overlap_probe as probe
    assert probe.main(["--quick", "--json", str(tmp_path / "o.json")]) == 0
    out = capsys.readouterr().out
    assert out.count("matches the reference") == 4   # one / pages copies x one / two buffer arrays
    rows = json.loads((tmp_path / "o.json").read_text())["rows"]
    assert {(r["copies"], r["buffers"], r["operand"]) for r in rows} >= {
        ("none", "one", "buffer"), ("pages", "two", "buffer"), ("one", "one", "other")}
    assert all(r["us_a_call"] > 0 for r in rows)


def test_overlap_probe_reports_a_kernel_that_disagrees(monkeypatch):
    from benchmarks import dma_overlap_probe as probe
    monkeypatch.setattr(probe, "probe_reference", lambda x, *a, **k: jnp.zeros((x.shape[0], 32)) + 1.0)
    with pytest.raises(SystemExit, match=r"max \|kernel - reference\|"):
        probe.main(["--quick"])


def test_overlap_probe_refuses_rows_off_its_pages():
    from benchmarks import dma_overlap_probe as probe
    with pytest.raises(SystemExit):
        probe.main(["--rows", "40"])


def test_lora_kernel_probe_quick(capsys, monkeypatch):
    from benchmarks import lora_kernel_probe
    from multilora.kernels.lora_pallas import CHUNK_ENV
    monkeypatch.setenv(CHUNK_ENV, "")   # the probe sets it for each chunk size: restored after
    lora_kernel_probe.main(["--quick", "--calls", "qkv", "--dims", "640,1536,640,256"])
    out = capsys.readouterr().out
    diffs = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "max |separate - one call|" in line]
    assert "us a layer" in out and diffs and max(diffs) < 2e-2, out   # bf16 outputs of the same sums


def test_tpu_steps_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "tpu_steps.sh")], check=True)
