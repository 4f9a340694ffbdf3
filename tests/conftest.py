"""Shared fixtures: tiny random HF checkpoints and PEFT adapters built with transformers + PEFT
(the references), saved as real folders."""

from __future__ import annotations

import os
import zlib

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch threads spin on a busy 2-core box
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Engines built with the defaults compare to PEFT at float32 exactly: projection_dtype "auto"
# would take bfloat16 where the CPU has AMX-BF16 or AVX512-BF16. The bfloat16 path is tested where it is asked for
# by name (test_projections.py, test_model_parity.py, test_engine.py).
os.environ.setdefault("MULTILORA_PROJECTION_DTYPE", "float32")

import pytest  # noqa: E402

from tests import reference  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """name -> folder, for a tiny Llama, a Qwen2 with q/k/v biases and a tied-embedding Llama."""
    root = tmp_path_factory.mktemp("models")
    return {name: reference.make_tiny_model(root / name, name) for name in reference.TINY_CONFIGS}


@pytest.fixture(scope="session")
def tiny_adapters(tiny_models, tmp_path_factory):
    """(model name, adapter name) -> folder of a PEFT adapter for that model."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for model_name, model_dir in tiny_models.items():
        for ad_name, spec in reference.ADAPTER_SPECS.items():
            out[(model_name, ad_name)] = reference.make_adapter(
                model_dir, root / model_name / ad_name, seed=zlib.crc32(ad_name.encode()) % 1000, **spec)
    return out


@pytest.fixture(scope="session")
def peft_refs(tiny_models, tiny_adapters):
    """model name -> reference.PeftReference holding all of that model's ADAPTER_SPECS adapters
    (each model loaded at most once per session; logits memoized)."""
    return {kind: reference.PeftReference(
                model_dir, {ad: tiny_adapters[(kind, ad)] for ad in reference.ADAPTER_SPECS})
            for kind, model_dir in tiny_models.items()}


@pytest.fixture(scope="session")
def peft_greedy_cache():
    """reference.PeftGreedyCache: PEFT greedy tokens, each (adapter, prompt) generated once."""
    return reference.PeftGreedyCache()
