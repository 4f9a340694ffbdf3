"""Where the Pallas LoRA kernel's time goes: another benchmark script run with a part of the
kernel taken out while Pallas traces it, so that the steps' times with and without that part say
what it costs. The results are wrong by design: for timing only, never for outputs.

    python3 benchmarks/lora_ablation.py no-copies benchmarks/forward_step.py --dtypes bfloat16 ...
    python3 benchmarks/lora_ablation.py no-math benchmarks/lora_kernel_probe.py --tokens 64

Ablations: `none` (the kernel as it is), `no-copies` (the adapters' page copies and their waits
left out: the math runs on whatever the buffers hold), `no-math` (the shrink and expand products
replaced by zeros: the copies still run), `bare` (both: the call, its grid and its scalars).
Only the LoRA kernel's trace is changed (multilora.kernels.lora_pallas._kernel, wrapped), nothing
else in the step.
"""

from __future__ import annotations

import contextlib
import runpy
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from multilora.kernels import lora_pallas  # noqa: E402

ABLATIONS = ("none", "no-copies", "no-math", "bare")


class _NoCopy:
    """A copy descriptor whose start and wait do nothing."""

    def start(self):
        pass

    def wait(self):
        pass


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _zeros_dot_general(lhs, rhs, dims, precision=None, preferred_element_type=None):
    (lc, rc), _ = dims
    shape = [s for i, s in enumerate(lhs.shape) if i not in lc] + [s for i, s in enumerate(rhs.shape) if i not in rc]
    return jnp.zeros(shape, preferred_element_type or lhs.dtype)


def _zeros_dot(a, b, precision=None, preferred_element_type=None):
    return jnp.zeros((a.shape[0], b.shape[1]), preferred_element_type or a.dtype)


def ablated_kernel(kernel, ablation: str):
    """kernel (lora_pallas._kernel) with `ablation`'s parts left out of its trace."""
    if ablation not in ABLATIONS:
        raise ValueError(f"unknown ablation {ablation!r}; one of {', '.join(ABLATIONS)}")

    def traced(*refs, **kw):
        with contextlib.ExitStack() as stack:
            if ablation in ("no-copies", "bare"):
                fake = types.SimpleNamespace(**{k: getattr(lora_pallas.pltpu, k) for k in dir(lora_pallas.pltpu)
                                                if not k.startswith("__")})
                fake.make_async_copy = lambda *a, **k: _NoCopy()
                stack.enter_context(_patched(lora_pallas, "pltpu", fake))
            if ablation in ("no-math", "bare"):
                stack.enter_context(_patched(jax.lax, "dot_general", _zeros_dot_general))
                stack.enter_context(_patched(jnp, "dot", _zeros_dot))
            return kernel(*refs, **kw)
    return traced


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2:
        raise SystemExit(f"usage: lora_ablation.py {{{'|'.join(ABLATIONS)}}} SCRIPT [ARGS...]")
    ablation, script, rest = argv[0], argv[1], argv[2:]
    lora_pallas._kernel = ablated_kernel(lora_pallas._kernel, ablation)
    print(f"# LoRA kernel ablation: {ablation} (timing only: outputs are wrong)", flush=True)
    sys.argv = [script] + rest
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
