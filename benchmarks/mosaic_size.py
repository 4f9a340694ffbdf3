"""The Pallas LoRA kernel's Mosaic module, lowered for a TPU v5e on any host (no TPU needed):
its serialized size with a chunk's adapter copies unrolled (the default) and issued in a loop
(MULTILORA_LORA_COPY_LOOP=1), for the calls of a LoRA step at SmolLM2-135M's shape. Mosaic's
compile on the chip (~14 s a step shape, benchmarks/log/37) grows with the module it is given;
this measures the module, not the compile.

    python benchmarks/mosaic_size.py [--tokens 64 512] [--adapters 8 64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

D, LAYERS, RANK = 576, 30, 16
CALLS = {"qkv": (D, (576, 192, 192)), "o": (576, (D,)), "gate_up": (D, (1536, 1536)), "down": (1536, (D,))}


def module_bytes(call: str, tokens: int, adapters: int) -> int:
    """Bytes of the tpu_custom_call's serialized kernel in the exported module (this process's
    MULTILORA_LORA_COPY_LOOP setting)."""
    import jax
    import jax.numpy as jnp
    from jax import export
    from jax._src.pallas.mosaic import tpu_info

    from multilora.kernels import lora_pallas
    # lowering asks for the chip's parameters: a v5e's, whatever this host is
    tpu_info.get_tpu_info = lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)
    d_in, outs = CALLS[call]
    slots = 1040
    sds = jax.ShapeDtypeStruct
    args = [sds((tokens, d_in), jnp.bfloat16), sds((LAYERS, len(outs) * slots, d_in), jnp.bfloat16),
            *[sds((LAYERS, slots, o), jnp.bfloat16) for o in outs], sds((adapters,), jnp.int32),
            sds((tokens,), jnp.int32), sds((adapters + 1, RANK), jnp.int32), sds((adapters + 1,), jnp.float32)]
    nb = len(outs)

    def f(x, a, *rest):
        bs, (step_slots, local, rows, scalings) = rest[:nb], rest[nb:]
        return lora_pallas.lora_deltas(x, a, bs, 3, step_slots, local, rows, scalings, a_blocks=nb)

    text = export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()
    return sum(len(line) for line in text.splitlines() if "tpu_custom_call" in line)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--adapters", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--one", nargs=3, metavar=("CALL", "TOKENS", "ADAPTERS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:  # a child: the copy-loop setting is read at trace time, once per process
        print(module_bytes(args.one[0], int(args.one[1]), int(args.one[2])))
        return
    rows = []
    print("call     tokens adapters  unrolled B   loop B   ratio")
    for tokens in args.tokens:
        for adapters in args.adapters:
            for call in CALLS:
                size = {}
                for loop in ("0", "1"):
                    env = dict(os.environ, JAX_PLATFORMS="cpu", MULTILORA_LORA_COPY_LOOP=loop)
                    out = subprocess.run([sys.executable, __file__, "--one", call, str(tokens), str(adapters)],
                                         env=env, capture_output=True, text=True, check=True)
                    size[loop] = int(out.stdout.split()[-1])
                rows.append(dict(call=call, tokens=tokens, adapters=adapters, unrolled=size["0"], loop=size["1"]))
                print(f"{call:8s} {tokens:6d} {adapters:8d} {size['0']:11d} {size['1']:8d} {size['0'] / size['1']:6.2f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
