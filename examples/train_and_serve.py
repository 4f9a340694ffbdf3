"""Train a LoRA in JAX and serve every K-th step's adapter from a running Engine, in one process,
with no file in between (issue 41): the loop that RL and online fine-tuning run thousands of times.

    python examples/train_and_serve.py            # the embedded SmolLM2-135M, 40 steps, a push every 10
    python examples/train_and_serve.py --quick    # 4 steps, a push every 2: the short form CI runs

Each push is `engine.load_lora_adapter("policy", tensors=..., config=..., load_inplace=True)`: the
adapter's arrays copied off the device, checked as a folder would be, and swapped in
copy-on-write (rollouts already queued finish on the weights they started with). Every rollout's
`lora_version` says which weights answered. The script prints each push's latency and the
rollouts' throughput.

The training forward here is a plain dense Llama (no cache, no paging: the engine's forward is
for serving); it supports the models without biases, q/k norms or Gemma's norms, which the
embedded model is.
"""

from __future__ import annotations

import argparse
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from multilora.config import LORA_MODULES, ModelConfig
from multilora.engine.request import SamplingParams
from multilora.model.layers import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq, swiglu
from multilora.model.loader import load_weights

TEXT = "The secret word is banana. The secret word is banana. The secret word is banana."
_WEIGHT = {"q_proj": "wq_LDO", "k_proj": "wk_LDO", "v_proj": "wv_LDO", "o_proj": "wo_LOD",
           "gate_proj": "w_gate_LDF", "up_proj": "w_up_LDF", "down_proj": "w_down_LFD"}


def init_lora(cfg: ModelConfig, rank: int, seed: int = 0) -> dict:
    """PEFT's start: A small and random, B zero (the first adapter changes nothing)."""
    key = jax.random.PRNGKey(seed)
    out = {}
    for m in LORA_MODULES:
        d_in, d_out = cfg.module_dims(m)
        key, sub = jax.random.split(key)
        out[m] = (jax.random.normal(sub, (cfg.num_layers, rank, d_in), jnp.float32) / np.sqrt(d_in),
                  jnp.zeros((cfg.num_layers, d_out, rank), jnp.float32))
    return out


def forward(weights, lora: dict, ids_T, cfg: ModelConfig, scaling: float):
    """Logits (T, V) of one sequence: the base model plus every projection's LoRA delta."""
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    t = ids_T.shape[0]
    cos, sin = rope_cos_sin(jnp.arange(t), rope_inv_freq(cfg))
    causal_TT = jnp.tril(jnp.ones((t, t), bool))

    def proj(x, w, ab):
        a_RI, b_OR = ab
        return x @ w + scaling * ((x @ a_RI.T) @ b_OR.T)

    def layer(x_TD, xs):
        lw, lo = xs
        hid = rms_norm(x_TD, lw.attn_norm_LD, cfg.rms_norm_eps)
        q = apply_rope(proj(hid, lw.wq_LDO, lo["q_proj"]).reshape(t, n, h), cos, sin)
        kk = apply_rope(proj(hid, lw.wk_LDO, lo["k_proj"]).reshape(t, k, h), cos, sin)
        v = proj(hid, lw.wv_LDO, lo["v_proj"]).reshape(t, k, h)
        kk, v = jnp.repeat(kk, n // k, axis=1), jnp.repeat(v, n // k, axis=1)
        s_NTT = jnp.einsum("tnh,snh->nts", q, kk) / np.sqrt(h)
        p_NTT = jax.nn.softmax(jnp.where(causal_TT, s_NTT, -1e30), axis=-1)
        att = jnp.einsum("nts,snh->tnh", p_NTT, v).reshape(t, n * h)
        x_TD = x_TD + proj(att, lw.wo_LOD, lo["o_proj"])
        hid = rms_norm(x_TD, lw.mlp_norm_LD, cfg.rms_norm_eps)
        mlp = swiglu(proj(hid, lw.w_gate_LDF, lo["gate_proj"]), proj(hid, lw.w_up_LDF, lo["up_proj"]))
        return x_TD + proj(mlp, lw.w_down_LFD, lo["down_proj"]), None

    x, _ = jax.lax.scan(layer, weights.embed_VD[ids_T], (weights.layers, lora))
    x = rms_norm(x, weights.final_norm_D, cfg.rms_norm_eps)
    head = weights.lm_head_DV if weights.lm_head_DV is not None else weights.embed_VD.T
    return x @ head


def peft_tensors(lora: dict) -> dict:
    """The adapter as PEFT names it: one device-to-host copy of each stacked array, then views."""
    host = jax.device_get(lora)
    out = {}
    for m, (a_LRI, b_LOR) in host.items():
        part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        for i in range(a_LRI.shape[0]):
            out[f"base_model.model.model.layers.{i}.{part}.{m}.lora_A.weight"] = a_LRI[i]
            out[f"base_model.model.model.layers.{i}.{part}.{m}.lora_B.weight"] = b_LOR[i]
    return out


def run(engine, steps: int, every: int, rank: int = 16, alpha: float = 32.0, lr: float = 3e-3,
        rollouts: int = 8, max_tokens: int = 16, seq_len: int = 48, log=print) -> dict:
    """Train `steps` steps on TEXT (token ids: random ones where the model has no tokenizer),
    pushing the adapter into `engine` in place every `every` steps and sampling `rollouts`
    from it. Returns the pushes' latencies (s) and the rollouts' tokens per second."""
    import optax

    cfg = engine.cfg
    _, weights = load_weights(engine.model_path, cfg, "float32")
    if engine.tokenizer is not None:
        ids = engine.tokenizer.encode(TEXT)[:seq_len]
    else:
        ids = np.random.default_rng(0).integers(3, cfg.vocab_size, size=seq_len).tolist()
    ids_T = jnp.asarray(ids, jnp.int32)
    prompt = ids[: max(2, len(ids) // 3)]
    scaling = alpha / rank
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(LORA_MODULES)}
    lora = init_lora(cfg, rank)
    opt = optax.adam(lr)
    state = opt.init(lora)

    @jax.jit
    def train_step(lora, state):
        def loss_fn(lora):
            logits = forward(weights, lora, ids_T[:-1], cfg, scaling)
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids_T[1:]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(lora)
        updates, state = opt.update(grads, state, lora)
        return optax.apply_updates(lora, updates), state, loss

    pushes, tok_s = [], []
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
    for step in range(1, steps + 1):
        lora, state, loss = train_step(lora, state)
        if step % every and step != steps:
            continue
        jax.block_until_ready(lora)
        t0 = time.perf_counter()
        engine.load_lora_adapter("policy", tensors=peft_tensors(lora), config=config,
                                 load_inplace="policy" in engine.registry.entries)
        pushes.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        outs = engine.generate([prompt] * rollouts, params, lora="policy")
        secs = time.perf_counter() - t0
        tok_s.append(sum(len(o.token_ids) for o in outs) / secs)
        sample = outs[0].text if engine.tokenizer is not None else outs[0].token_ids[:8]
        log(f"step {step}: loss {float(loss):.3f}; push {pushes[-1] * 1e3:.1f} ms ({outs[0].lora_version}); "
            f"{rollouts} rollouts at {tok_s[-1]:.0f} tok/s; e.g. {sample!r}")
    return {"push_s": pushes, "rollout_tok_s": tok_s, "versions": {o.lora_version for o in outs}}


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10, help="push the adapter every K steps")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="4 steps, a push every 2, 4 short rollouts")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.every, args.rollouts = 4, 2, 4
    from multilora.engine.engine import Engine
    engine = Engine(args.model, max_lora_rank=args.rank, max_loras_per_batch=2, max_num_seqs=16,
                    max_model_len=256, lora_backend="bgmv")
    res = run(engine, args.steps, args.every, rank=args.rank, rollouts=args.rollouts,
              max_tokens=8 if args.quick else 24)
    p = sorted(res["push_s"])
    print(f"pushes: median {p[len(p) // 2] * 1e3:.1f} ms, max {p[-1] * 1e3:.1f} ms; rollouts: "
          f"{np.median(res['rollout_tok_s']):.0f} tok/s (median)")
    return res


if __name__ == "__main__":
    main()
