"""Shared fixtures: tiny random HF checkpoints and PEFT adapters built with transformers + PEFT
(the references), saved as real folders."""

from __future__ import annotations

import os
import tempfile
import zlib

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch threads spin on a busy 2-core box
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Engines built with the defaults compare to PEFT at float32 exactly: projection_dtype "auto"
# would take bfloat16 where the CPU has AMX-BF16 or AVX512-BF16. The bfloat16 path is tested where it is asked for
# by name (test_projections.py, test_model_parity.py, test_engine.py).
os.environ.setdefault("MULTILORA_PROJECTION_DTYPE", "float32")
# JAX's persistent compilation cache (which engines turn on) in a folder of this test session's
# own: runs of other checkouts on the same machine never read or write the same entries (a read
# racing another process's write crashed a run), and executables that hold host callbacks
# (Pallas's interpreter, the kernels' CPU tests) never outlive the process that made them.
os.environ.setdefault("MULTILORA_COMPILATION_CACHE", tempfile.mkdtemp(prefix="multilora-jax-cache-"))

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


# Tiers, one per test file (run one with `pytest -m unit`, or `-m "not e2e"`):
#   unit    one component against its definition or a plain reference, no model of any size
#   model   a tiny model end to end (engine, kernels in place) against transformers + PEFT
#   server  the HTTP server (and Ray Serve's) in this process, through an OpenAI client
#   e2e     real processes: `multilora serve`, several engine processes, the default model
TIERS = {
    "unit": ["test_arrays", "test_packing", "test_attention", "test_batch_invariance", "test_attention_pallas", "test_backends", "test_capabilities", "test_docs",
             "test_imports", "test_cli", "test_kv_pages", "test_kv_write", "test_lora_pallas", "test_loader", "test_logits_process", "test_lora_slots",
             "test_pacing", "test_projections", "test_registry", "test_safetensors_views", "test_step_budget",
             "test_sampler", "test_scheduler", "test_adapter_errors", "test_warmup", "test_tool_parsers", "test_tpu_probes"],
    "model": ["test_model_parity", "test_model_variants", "test_engine", "test_async_scheduling", "test_speculative", "test_prefix_cache", "test_structured",
              "test_demo_adapters", "test_gguf_default", "test_quantization", "test_adapter_tensors", "test_budgeted_steps",
              "test_moe", "test_moe_per_expert", "test_precision", "test_engine_lifecycle"],
    "server": ["test_server", "test_server_tools", "test_ray_serve", "test_lm_eval_client", "test_faults"],
    "e2e": ["test_serve_processes", "test_tensor_parallel"],
}
TIER_OF = {module: tier for tier, modules in TIERS.items() for module in modules}
# The slowest files first (CI's --durations): CI's two workers take whole files in collection order
# (--dist loadfile), and the longest one taken late leaves one worker running alone at the end.
SLOWEST_FIRST = ("test_model_parity", "test_engine", "test_serve_processes", "test_ray_serve",
                 "test_tensor_parallel", "test_backends", "test_server", "test_faults", "test_lora_pallas",
                 "test_model_variants", "test_attention_pallas", "test_server_tools")


def pytest_collection_modifyitems(config, items):
    """Mark every test with its file's tier (a test file in no tier is an error, so that each
    new file says which tier it belongs to), and put the slowest files first."""
    for item in items:
        module = item.path.stem
        if module not in TIER_OF:
            raise pytest.UsageError(f"tests/{module}.py is in no tier: add it to TIERS in tests/conftest.py")
        item.add_marker(getattr(pytest.mark, TIER_OF[module]))
    rank = {module: i for i, module in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a file's tests keep their order


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """After each test file: drop JAX's caches of compiled programs. Each XLA CPU executable holds
    memory mappings of its JIT code; the whole suite in one process compiles enough of them to
    pass the kernel's limit on mappings (vm.max_map_count, 65530), and then LLVM's next
    compilation fails ("Cannot allocate memory") and the process dies. Engines a file still
    holds keep their own executables; the next file compiles what it needs again."""
    yield
    import gc

    import jax
    jax.clear_caches()
    gc.collect()
    log = os.environ.get("MULTILORA_TEST_MAPS_LOG")  # where the process's mapping count after each file goes
    if log:
        with open("/proc/self/maps") as maps, open(log, "a") as out:
            out.write(f"{request.module.__name__} {sum(1 for _ in maps)}\n")
