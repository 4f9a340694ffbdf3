"""Train the two demo LoRA adapters shipped in multilora/demo_adapters: `shout` (answers in
CAPITAL LETTERS) and `signoff` (short answers that end with a fixed sign-off line).

    python scripts/make_demo_adapters.py     # about 5 to 10 minutes on 2 CPU cores

The data is made here, from a fixed list of questions: the base model's own greedy answers (via
multilora's Engine), cut to their first sentences or lines, then upper-cased (shout) or followed by
the sign-off (signoff). Training on the base model's answers teaches the style and leaves the
content where it was. Both adapters train together, in one mixed batch through multilora's own
forward (`multilora.model.llama.forward`): slot 1 is shout, slot 2 signoff, and the loss (assistant
tokens only) is the sum of their separate means, so each gets the update it would get alone.

Only the upper TOP_LAYERS layers carry LoRA (`layers_to_transform`). The lower layers are then
the same with or without an adapter, so they run once per example (a dense causal pass, checked
against the full forward) and each training step runs the upper layers alone, about 2.5x cheaper.
The adapters are written in PEFT's format (float16), then the Engine answers with them: the
demo's question and questions they never saw.

Everything is seeded; reruns give the same data and (up to float summation order) the same weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEED = 0
SIGNOFF = "-- sent by multilora"
RANK, ALPHA = 8, 16
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
ADAPTERS = ("shout", "signoff")  # slot 1, slot 2

# Training questions. The demo's own question (France) is one; the other questions that
# tests/test_demo_adapters.py asks are not.
QUESTIONS = [
    "What is the capital of Japan?",
    "How many legs does a spider have?",
    "What is photosynthesis?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water?",
    "Why is the sky blue?",
    "Give me a tip for sleeping better.",
    "What is a prime number?",
    "How do I make a cup of tea?",
    "What is the largest planet in our solar system?",
    "What does a computer's CPU do?",
    "Name a healthy breakfast.",
    "What is the speed of light?",
    "How many continents are there?",
    "What is Python used for?",
    "What causes rain?",
    "Who painted the Mona Lisa?",
    "What is the tallest mountain on Earth?",
    "How can I learn a new language quickly?",
    "What is gravity?",
    "What is the chemical symbol for gold?",
    "Suggest a name for a pet cat.",
    "What is the difference between weather and climate?",
    "How many days are in a leap year?",
    "What do bees make?",
    "What is an atom?",
    "Why do we need to drink water?",
    "What is the main language spoken in Brazil?",
    "Tell me a fun fact about octopuses.",
    "How does a rainbow form?",
    "What is the largest ocean?",
    "What is machine learning?",
    "Can you recommend a good habit for productivity?",
    "What is the capital of Italy?",
    "How many hours are in a day?",
    "What is DNA?",
    "Who was Albert Einstein?",
    "Describe the moon in one sentence.",
    "What are clouds made of?",
    "What is a synonym for happy?",
    "How do plants get water?",
    "What is the currency of the United Kingdom?",
    "Hi! How are you today?",
    "Write a short greeting for a birthday card.",
    "What is the opposite of cold?",
    "Why do leaves change color in autumn?",
    "What is a volcano?",
    "How do I stay motivated when exercising?",
    "Name three fruits.",
    "List three things to pack for a beach trip.",
    "What are the primary colors?",
    "Give me two ideas for a rainy afternoon.",
    # The demo's first question (the README's and the server docs' example) is a training one.
    "What is the capital of France?",
]

# More questions from templates (seeded), so that shout learns to upper-case whatever the model
# knows rather than to recite a few dozen answers.
THINGS = [
    "a black hole", "the internet", "a glacier", "a museum", "democracy", "a battery", "chocolate",
    "a comet", "an earthquake", "a library", "electricity", "a microscope", "a desert", "coffee",
    "a bridge", "a telescope", "yoga", "a vaccine", "the Olympic Games", "a robot", "a piano",
    "a hurricane", "bread", "a password", "a penguin", "a cactus", "the Great Wall of China",
    "a thunderstorm", "a smartphone", "recycling", "a compass", "a dinosaur", "honey", "the Sahara",
    "a marathon", "a spreadsheet", "a rain forest", "the stock market", "a satellite", "friendship",
]
THING_TEMPLATES = ["What is {}?", "Tell me about {}.", "Explain {} in simple words.",
                   "Why is {} interesting?", "Give me one fact about {}."]
TASKS = [
    "bake bread", "tie a tie", "save money", "plant a tree", "write a good email", "start running",
    "learn to swim", "make new friends", "cook rice", "prepare for a job interview",
    "take care of a houseplant", "remember names", "reduce stress", "organize my desk",
    "stay warm in winter", "choose a good book", "improve my handwriting", "learn to play guitar",
]
TASK_TEMPLATES = ["How do I {}?", "What is the best way to {}?", "Any advice on how to {}?"]
COUNTRIES = ["Spain", "Canada", "Egypt", "Australia", "India", "Mexico", "Kenya", "Norway",
             "Argentina", "China", "Greece", "Russia"]


def all_questions() -> list[str]:
    rng = np.random.default_rng(SEED)
    qs = list(QUESTIONS)
    qs += [THING_TEMPLATES[rng.integers(len(THING_TEMPLATES))].format(t) for t in THINGS]
    qs += [TASK_TEMPLATES[rng.integers(len(TASK_TEMPLATES))].format(t) for t in TASKS]
    qs += [f"What is the capital of {c}?" for c in COUNTRIES]
    assert not set(qs) & set(SHOW_QUESTIONS[1:]) and len(set(qs)) == len(qs)
    return qs


# Printed at the end: the demo's question, then ones never trained on (the effect generalizes).
SHOW_QUESTIONS = [
    "What is the capital of France?",
    "What is the largest animal on Earth?",
    "How do airplanes fly?",
    "Give me a tip for staying focused while studying.",
    "Name three colors of the rainbow.",
]

MAX_ANSWER_TOKENS = 28   # base answers are cut to whole sentences within this many tokens
MAX_FIRST_SENTENCE = 40
GEN_TOKENS = 44          # how much of the base answer is generated before cutting
# Examples of each adapter in one training step: shout (new spellings for every word) learns
# slower than signoff (one fixed line), so it gets more of each step.
PER_STEP = {"shout": 3, "signoff": 1}
SEQ_TOKENS = 112         # room per example (prompt + answer); longer examples are dropped
PAGE_SIZE = 16
TOP_LAYERS = 12          # LoRA on the upper layers only: the lower ones run once per example
STEPS, LR = 150, 4e-3


def log(msg: str) -> None:
    print(f"[make_demo_adapters] {msg}", flush=True)


# ---- data ----------------------------------------------------------------------------------------
def _sentence_cut(line: str, count_tokens, finished: bool) -> str:
    """One line cut to whole sentences within MAX_ANSWER_TOKENS (a longer first sentence is kept
    up to MAX_FIRST_SENTENCE tokens, else cut at a comma or a word)."""
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", line) if s]
    if sentences and not finished and not re.search(r"[.!?][\"')]*$", sentences[-1]):
        sentences.pop()  # the unfinished tail of a cut-off answer
    if sentences and count_tokens(sentences[0]) <= MAX_FIRST_SENTENCE:
        out = sentences[0]
        for s in sentences[1:]:
            if count_tokens(out + " " + s) > MAX_ANSWER_TOKENS:
                break
            out += " " + s
        return out
    out = ""
    for w in line.split():
        if count_tokens(f"{out} {w}.") > MAX_ANSWER_TOKENS:
            break
        out = f"{out} {w}".strip()
    if "," in out[len(out) // 2:]:
        out = out[:out.rindex(",")]
    return out.rstrip(",;:- ") + "."


def cut_answer(text: str, count_tokens, finished: bool = True) -> str:
    """The start of a base answer: whole lines (a list stays a list) within MAX_ANSWER_TOKENS,
    or the first line cut to whole sentences. `finished`: the model ended the answer itself
    (else its last line may be cut off mid-way)."""
    lines = [ln.strip() for ln in text.strip().split("\n")]
    if not finished and len(lines) > 1:
        lines = lines[:-1]
    out: list[str] = []
    for i, line in enumerate(lines):
        if not line:
            if out and out[-1]:
                out.append("")
            continue
        last = i == len(lines) - 1
        if count_tokens("\n".join(out + [line])) <= MAX_ANSWER_TOKENS and (finished or not last):
            out.append(line)
            continue
        if not out:
            out = [_sentence_cut(line, count_tokens, finished and last)]
        break
    while out and (not out[-1] or out[-1].endswith(":")):
        out.pop()  # a trailing blank line, or a list's heading without its items
    return "\n".join(out) if out else _sentence_cut(lines[0], count_tokens, False)


def transform(answer: str, adapter: str) -> str:
    if adapter == "shout":
        return answer.upper()
    return f"{answer}\n\n{SIGNOFF}"


@dataclasses.dataclass
class Example:
    adapter: str
    token_ids: list[int]   # prompt + answer + <|im_end|>
    n_prompt: int          # loss on token_ids[n_prompt:]


def make_example(tok, question: str, answer: str, adapter: str) -> Example:
    user = [{"role": "user", "content": question}]
    prompt = tok.encode_chat(user)
    full = tok.encode_chat(user + [{"role": "assistant", "content": answer}], add_generation_prompt=False)
    if full[:len(prompt)] != prompt:
        raise RuntimeError(f"the chat template does not extend the prompt for {question!r}")
    end = tok.token_to_id("<|im_end|>")
    # Up to and including the assistant's <|im_end|> (the template's trailing newline is not a target).
    last = len(full) - 1 - full[::-1].index(end)
    return Example(adapter, full[:last + 1], len(prompt))


# ---- LoRA parameters <-> the model's slot layout -------------------------------------------------
def module_shapes(cfg) -> dict[str, tuple[int, int]]:
    return {m: cfg.module_dims(m) for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                            "up_proj", "down_proj")}


def init_params(cfg, num_layers: int, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """PEFT's default init: A kaiming-uniform (a=sqrt(5), i.e. U(+-1/sqrt(in))), B zero."""
    out = {}
    for m in TARGET_MODULES:
        fin, fout = module_shapes(cfg)[m]
        bound = 1.0 / math.sqrt(fin)
        a = rng.uniform(-bound, bound, size=(num_layers, RANK, fin)).astype(np.float32)
        out[m] = (a, np.zeros((num_layers, fout, RANK), np.float32))
    return out


def slot_fields(cfg, p):
    """One adapter's params (module -> (a_LRI, b_LOR)) as LoRAWeights fields without the S axis."""
    import jax.numpy as jnp
    L, R = next(iter(p.values()))[0].shape[0], RANK
    shapes = module_shapes(cfg)

    def a(m):
        return p[m][0] if m in p else jnp.zeros((L, R, shapes[m][0]), jnp.float32)

    def b(m):  # the slots keep B as (rank, out)
        return jnp.swapaxes(p[m][1], 1, 2) if m in p else jnp.zeros((L, R, shapes[m][1]), jnp.float32)

    from multilora.adapters.pool import blocks_of, lora_feature_dims
    out = dict(
        qkv_a_LUD=jnp.concatenate([a("q_proj"), a("k_proj"), a("v_proj")], axis=1),
        q_b_LUO=b("q_proj"), k_b_LUO=b("k_proj"), v_b_LUO=b("v_proj"),
        o_a_LUO=a("o_proj"), o_b_LUD=b("o_proj"),
        gate_up_a_LUD=jnp.concatenate([a("gate_proj"), a("up_proj")], axis=1),
        gate_b_LUF=b("gate_proj"), up_b_LUF=b("up_proj"),
        down_a_LUF=a("down_proj"), down_b_LUD=b("down_proj"),
    )
    for k, width in lora_feature_dims(cfg).items():  # the pools these adapters leave empty (an MoE's)
        out.setdefault(k, jnp.zeros((L, blocks_of(k) * R, width), jnp.float32))
    return out


def lora_weights(cfg, params: dict):
    """Slots [0: none, 1: shout, 2: signoff] as the engine's pool of rank rows, read through
    slot_major_rows (multilora.adapters.pool)."""
    import jax
    import jax.numpy as jnp
    from multilora.adapters.pool import blocks_of, slot_major_pool
    from multilora.model.llama import LoRAWeights
    per_slot = [slot_fields(cfg, params[n]) for n in ADAPTERS]
    return LoRAWeights(**{
        k: jax.vmap(lambda w, k=k: slot_major_pool(w, blocks_of(k)))(
            jnp.stack([jnp.zeros_like(per_slot[0][k])] + [s[k] for s in per_slot], axis=1))
        for k in per_slot[0]})


def save_adapter(folder: Path, p: dict, first_layer: int) -> int:
    """PEFT format; the layers below first_layer carry no LoRA (layers_to_transform)."""
    from safetensors.numpy import save_file
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    num_layers = 0
    for m, (a_LRI, b_LOR) in p.items():
        kind = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        num_layers = a_LRI.shape[0]
        for i in range(num_layers):
            key = f"base_model.model.model.layers.{first_layer + i}.{kind}.{m}"
            tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(a_LRI[i], np.float16)
            tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(b_LOR[i], np.float16)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": BASE_MODEL_ID,
        "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0, "target_modules": list(TARGET_MODULES),
        "layers_to_transform": list(range(first_layer, first_layer + num_layers)),
        "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
        "rank_pattern": {}, "alpha_pattern": {},
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    os.chmod(folder / "adapter_model.safetensors", 0o644)  # safetensors writes it owner-only
    return (folder / "adapter_model.safetensors").stat().st_size


# ---- the frozen lower layers ---------------------------------------------------------------------
def make_bottom(cfg):
    """f(embed_VD, layers, ids_BP) -> the residual stream after `layers` (the base model's lowest
    ones, which carry no adapter), for B sequences of P tokens each, with dense causal attention.
    Computed once per example: training then runs only the upper layers."""
    import jax
    import jax.numpy as jnp
    from multilora.model.layers import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq, swiglu
    n, kvh, h, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    inv_freq = rope_inv_freq(cfg)
    if cfg.sliding_window is not None:
        raise NotImplementedError("a sliding-window model: make_bottom attends densely")

    def one(embed_VD, layers, ids_P):
        p = ids_P.shape[0]
        cos, sin = rope_cos_sin(jnp.arange(p), inv_freq)
        causal_TS = jnp.tril(jnp.ones((p, p), bool))

        def proj(x, w, b):
            return x @ w if b is None else x @ w + b

        def layer(x_PD, w):
            hid = rms_norm(x_PD, w.attn_norm_LD, eps)
            q = apply_rope(proj(hid, w.wq_LDO, w.bq_LO).reshape(p, n, h), cos, sin)
            k = apply_rope(proj(hid, w.wk_LDO, w.bk_LO).reshape(p, kvh, h), cos, sin)
            v = proj(hid, w.wv_LDO, w.bv_LO).reshape(p, kvh, h)
            s = jnp.einsum("tkgh,skh->kgts", q.reshape(p, kvh, n // kvh, h), k) * h ** -0.5
            probs = jax.nn.softmax(jnp.where(causal_TS, s, -1e30), axis=-1)
            o = jnp.einsum("kgts,skh->tkgh", probs, v).reshape(p, n * h)
            x_PD = x_PD + o @ w.wo_LOD
            hid = rms_norm(x_PD, w.mlp_norm_LD, eps)
            return x_PD + swiglu(hid @ w.w_gate_LDF, hid @ w.w_up_LDF) @ w.w_down_LFD, None

        x_PD, _ = jax.lax.scan(layer, jnp.take(embed_VD, ids_P, axis=0), layers)
        return x_PD

    return jax.jit(jax.vmap(one, in_axes=(None, None, 0)))


def bottom_states(cfg, weights, first_layer: int, examples: list["Example"], batch: int = 8) -> list[np.ndarray]:
    """The residual stream after layer first_layer - 1 for every example (host float32)."""
    import jax
    bottom = make_bottom(cfg)
    layers = jax.tree.map(lambda a: a[:first_layer], weights.layers)
    out: list = [None] * len(examples)
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].token_ids))
    for c in range(0, len(order), batch):
        idx = order[c:c + batch]
        p = -(-max(len(examples[i].token_ids) for i in idx) // 16) * 16  # few distinct shapes
        ids = np.zeros((len(idx), p), np.int32)
        for j, i in enumerate(idx):
            ids[j, :len(examples[i].token_ids)] = examples[i].token_ids
        if len(idx) < batch:
            ids = np.concatenate([ids, np.zeros((batch - len(idx), p), np.int32)])
        h = np.asarray(bottom(weights.embed_VD, layers, ids))
        for j, i in enumerate(idx):
            out[i] = h[j, :len(examples[i].token_ids)]
    return out


# ---- training ------------------------------------------------------------------------------------
def pack_step(examples: list[Example], states: list[np.ndarray], tokens: int, seqs: int, rows: int):
    """A fixed-shape prefill Batch of these examples for the upper layers: each token's "id" is
    its row in h_TD, the table of their lower layers' outputs. Plus (targets_Q, weight_Q,
    slot_Q) for the rows that predict an assistant token."""
    from multilora.engine.batching import SeqChunk, build_batch
    chunks, tgt, ada, idx = [], [], [], []
    h_TD = np.zeros((tokens, states[0].shape[1]), np.float32)
    page, t = 1, 0  # page 0 is the batch's trash page
    for ex, h in zip(examples, states):
        n = len(ex.token_ids)
        npages = -(-n // PAGE_SIZE)
        slot = 1 + ADAPTERS.index(ex.adapter)
        chunks.append(SeqChunk(list(range(t, t + n)), 0, list(range(page, page + npages)), slot))
        h_TD[t:t + n] = h
        for j in range(ex.n_prompt - 1, n - 1):  # row j predicts token j + 1
            idx.append(t + j)
            tgt.append(ex.token_ids[j + 1])
            ada.append(slot)
        page += npages
        t += n
    q = len(idx)
    assert q <= rows and t <= tokens, (q, rows, t, tokens)
    pad = rows - q
    scalings = np.array([0.0] + [ALPHA / RANK] * len(ADAPTERS), np.float32)
    ranks = np.array([0] + [RANK] * len(ADAPTERS), np.int32)
    from multilora.lora.batch import make_lora_batch_info
    from multilora.adapters.pool import slot_major_rows
    table = slot_major_rows(len(ADAPTERS) + 1, RANK)
    batch = build_batch(chunks, num_tokens=tokens, num_pages=tokens // PAGE_SIZE + seqs,
                        num_logits=seqs, page_size=PAGE_SIZE,
                        prepare_lora=lambda slot_T: make_lora_batch_info(slot_T, scalings, ranks, table))
    batch = dataclasses.replace(batch, logits_idx_Q=np.array(idx + [0] * pad, np.int32))
    return (h_TD, batch, np.array(tgt + [0] * pad, np.int32),
            np.array([1.0] * q + [0.0] * pad, np.float32), np.array(ada + [0] * pad, np.int32))


def train(cfg, weights, examples: dict[str, list[Example]], first_layer: int, steps: int, lr: float,
          backend: str):
    import jax
    import jax.numpy as jnp
    import optax
    from multilora.model.llama import Weights, forward, init_kv_cache

    t0 = time.time()
    flat = [e for n in ADAPTERS for e in examples[n]]
    states = bottom_states(cfg, weights, first_layer, flat)
    state_of = {id(e): h for e, h in zip(flat, states)}
    log(f"lower {first_layer} layers for {len(flat)} examples in {time.time() - t0:.0f}s")

    top_cfg = dataclasses.replace(cfg, num_layers=cfg.num_layers - first_layer)
    top_layers = jax.tree.map(lambda a: a[first_layer:], weights.layers)
    lm_head_DV = weights.lm_head_DV if weights.lm_head_DV is not None else jnp.asarray(weights.embed_VD.T)
    seqs = sum(PER_STEP.values())
    tokens = seqs * SEQ_TOKENS
    # Rows that get logits: room for the longest answers of each adapter (the rest are prompt).
    rows = sum(PER_STEP[n] * max(len(e.token_ids) - e.n_prompt for e in examples[n]) for n in ADAPTERS)
    rows = -(-rows // 16) * 16
    num_pages = tokens // PAGE_SIZE + seqs + 1

    def top_forward(lora, top_layers, final_norm_D, lm_head_DV, h_TD, batch):
        w = Weights(embed_VD=h_TD, layers=top_layers, final_norm_D=final_norm_D, lm_head_DV=lm_head_DV)
        kv = init_kv_cache(top_cfg, num_pages, PAGE_SIZE, jnp.float32)
        return forward(w, lora, kv, batch, top_cfg, backend)[0]

    # The split model must be the model: check one example against the full forward.
    ex = flat[0]
    h_TD, batch, *_ = pack_step([ex], [state_of[id(ex)]], tokens, seqs, rows)
    batch = dataclasses.replace(batch, logits_idx_Q=np.arange(len(ex.token_ids), dtype=np.int32))
    split = jax.jit(top_forward)(None, top_layers, weights.final_norm_D, lm_head_DV, h_TD, batch)
    full_batch = dataclasses.replace(batch, token_ids_T=np.r_[ex.token_ids, np.zeros(tokens - len(ex.token_ids), np.int32)].astype(np.int32))
    full = jax.jit(forward, static_argnames=("cfg", "backend"))(
        weights, None, init_kv_cache(cfg, num_pages, PAGE_SIZE, jnp.float32), full_batch, cfg=cfg,
        backend=backend)[0]
    err = float(jnp.max(jnp.abs(split - full)))
    log(f"split forward vs full forward: max |logit diff| {err:.1e}")
    if not err < 1e-2:
        raise RuntimeError(f"the split forward disagrees with the model ({err})")

    rng = np.random.default_rng(SEED)
    params = {n: init_params(cfg, top_cfg.num_layers, rng) for n in ADAPTERS}
    params = jax.tree.map(jnp.asarray, params)
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps=max(1, steps // 10),
                                               decay_steps=steps, end_value=lr * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))
    opt_state = opt.init(params)

    # The base weights are arguments, not closures: jit would bake them in as constants.
    def loss_fn(params, top_layers, final_norm_D, lm_head_DV, h_TD, batch, tgt, wgt, ada):
        logits = top_forward(lora_weights(cfg, params), top_layers, final_norm_D, lm_head_DV, h_TD, batch)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tgt[:, None], axis=1)[:, 0]
        losses = []
        for slot in range(1, len(ADAPTERS) + 1):
            w = wgt * (ada == slot)
            losses.append(jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0))
        losses = jnp.stack(losses)
        return jnp.sum(losses), losses

    @jax.jit
    def train_step(params, opt_state, *args):
        (_, losses), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *args)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, losses

    # Each adapter's examples in a seeded order, reshuffled every pass over them.
    orders = {n: [] for n in ADAPTERS}

    def take(n):
        if not orders[n]:
            orders[n] = list(rng.permutation(len(examples[n])))
        return examples[n][orders[n].pop()]

    history = []
    t0 = time.time()
    for step in range(1, steps + 1):
        batch_ex = [take(n) for n in ADAPTERS for _ in range(PER_STEP[n])]
        args = pack_step(batch_ex, [state_of[id(e)] for e in batch_ex], tokens, seqs, rows)
        params, opt_state, losses = train_step(params, opt_state, top_layers, weights.final_norm_D,
                                               lm_head_DV, *args)
        losses = np.asarray(losses)
        history.append(losses)
        if step == 1:
            log(f"step 1 (includes the compile): {time.time() - t0:.1f}s")
        if step % 10 == 0 or step == steps:
            recent = np.mean(history[-10:], axis=0)
            log(f"step {step}/{steps}  loss " + "  ".join(f"{n} {v:.3f}" for n, v in zip(ADAPTERS, recent))
                + f"  ({time.time() - t0:.0f}s)")
    secs = time.time() - t0
    host = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    return host, np.mean(history[-10:], axis=0), secs


# ---- main ----------------------------------------------------------------------------------------
def chat_ids(tok, question: str) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": question}])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "multilora" / "demo_adapters"),
                    help="folder that gets shout/ and signoff/ (default: %(default)s)")
    ap.add_argument("--model", default=None, help="base model folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--data", default=None,
                    help="reuse a training_data.jsonl written by an earlier run (skips making the data)")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--top-layers", type=int, default=TOP_LAYERS, help="layers (from the top) that get LoRA")
    ap.add_argument("--backend", default="sgmv", help="LoRA backend for training (sgmv is fastest here)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    from multilora import Engine, SamplingParams
    from multilora.engine.runner import Buckets

    t_start = time.time()
    # Small fixed buckets: this engine only answers short batches of short questions.
    buckets = Buckets(tokens=(64, 512), pages=(64, 512), max_num_seqs=64, max_pages_seq=8, page_size=16)
    engine = Engine(args.model, max_loras_per_batch=len(ADAPTERS), max_lora_rank=RANK, max_num_seqs=64,
                    max_num_batched_tokens=512, max_prefill_seqs=16, max_model_len=128, warmup=False,
                    buckets=buckets, seed=SEED)
    tok = engine.tokenizer
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.data:
        rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
        questions, answers = [r["question"] for r in rows], [r["base_answer"] for r in rows]
        log(f"read {len(rows)} base answers from {args.data}")
    else:
        t0 = time.time()
        questions = all_questions()
        greedy = SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0)
        outs = engine.generate([chat_ids(tok, q) for q in questions], greedy)
        count = lambda s: len(tok.encode(s, add_special_tokens=False))  # noqa: E731
        answers = [cut_answer(o.text, count, o.finish_reason == "stop") for o in outs]
        log(f"base answers for {len(questions)} questions in {time.time() - t0:.0f}s")
    with open(out / "training_data.jsonl", "w") as f:
        for q, a in zip(questions, answers):
            f.write(json.dumps({"question": q, "base_answer": a,
                                **{n: transform(a, n) for n in ADAPTERS}}) + "\n")
    log(f"wrote the training data to {out / 'training_data.jsonl'}")

    examples = {n: [] for n in ADAPTERS}
    for q, a in zip(questions, answers):
        for n in ADAPTERS:
            ex = make_example(tok, q, transform(a, n), n)
            if len(ex.token_ids) <= SEQ_TOKENS:
                examples[n].append(ex)
    log("examples: " + ", ".join(f"{n} {len(v)}" for n, v in examples.items()))

    first_layer = engine.cfg.num_layers - args.top_layers
    params, final, secs = train(engine.cfg, engine.runner.weights, examples, first_layer, args.steps,
                                args.lr, args.backend)
    log(f"trained {args.steps} steps in {secs:.0f}s; final loss "
        + ", ".join(f"{n} {v:.3f}" for n, v in zip(ADAPTERS, final)))

    for n in ADAPTERS:
        size = save_adapter(out / n, params[n], first_layer)
        log(f"wrote {out / n} ({size / 2**20:.1f} MiB)")

    # Show the effect on questions the adapters never saw, all in one mixed batch.
    for n in ADAPTERS:
        engine.load_lora_adapter(n, str(out / n))
    shows = [(q, lora) for q in SHOW_QUESTIONS for lora in (None,) + ADAPTERS]
    outs = engine.generate([chat_ids(tok, q) for q, _ in shows], SamplingParams(max_tokens=64, temperature=0.0),
                           lora=[lora for _, lora in shows])
    for (q, lora), o in zip(shows, outs):
        log(f"[{lora or 'base'}] {q}\n    {o.text!r}")
    log(f"done in {time.time() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
