"""The one place that jits: the model step and the sampler, over a fixed set of shape buckets
compiled at start-up. An adapter swap changes buffer contents, never shapes, so nothing compiles
after warm-up whatever the prompts or the adapter mix (a compile after warm-up logs a warning).
Warm-up compiles every bucket before the first step, or (a server's, `background=True`) the few a
first short request lands on before it and the rest behind it; a step that needs a shape not yet
compiled compiles it or waits for the thread compiling it (multilora.engine.warmup).

Buckets: every step, whatever its mix of decode rows and prefill chunks, is (T tokens, X pages
in all), with Q = min(T, max_num_seqs) logits rows.

Sharding: the weights, LoRA slots and KV cache arrive placed on the mesh (the rules table); the
step is compiled for exactly those shardings, returns the cache in the same sharding (so the
donated cache comes back as it went in, step after step) and the logits replicated; each step's
host arrays are compiled for as replicated inputs. On one device all of this is a 1-device mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from multilora.config import ModelConfig
from multilora.engine.batching import SeqChunk, build_batch, decode_first, pages_needed
from multilora.engine.logits_process import MAX_BIAS_ENTRIES, apply_token_bitmask, process_logits
from multilora.engine.sampler import NUM_LOGPROBS, sample
from multilora.engine.structured import allow_all, mask_words
from multilora.engine.warmup import ShapeCompiler
from multilora.lora.backend import SWITCH, choose_backend, get_backend, grouped_cap, native_usable
from multilora.adapters.pool import LoRASlots
from multilora.model.attention import native_attention_usable
from multilora.model.packing import abstract_buffer, pack
from multilora.model.llama import (KVCache, Weights, forward_packed, is_heads_major, kv_cache_formats, kv_write_mode,
                                   pallas_attention_on, token_logprobs)

log = logging.getLogger("multilora.runner")


def _pow2_range(lo: int, hi: int) -> tuple[int, ...]:
    out, v = [], 1
    while v < lo:
        v *= 2
    while v < hi:
        out.append(v)
        v *= 2
    out.append(hi if not out or out[-1] < hi else out[-1])
    return tuple(sorted(set(out)))


MIN_TOKENS_BUCKET = 4  # below this a step costs the same (the weights are read either way)
MIN_PAGES_BUCKET = 4
# A background warm-up compiles, before the server answers, the shapes that one request of up to
# this many prompt tokens lands on alone (its prefill in one step, then its decode): a chat's
# first question; anything else compiles behind it, or on demand.
FIRST_PROMPT_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Every step is one shape family: T packed tokens (decode rows and prefill chunks together)
    over X pages (the flat list of the step's pages), with Q = min(T, max_num_seqs) logits rows.
    Powers of two for both: a step pads at most 2x its tokens and 2x its pages (docs/engine.md)."""

    tokens: tuple[int, ...]
    pages: tuple[int, ...]
    max_num_seqs: int
    max_pages_seq: int
    page_size: int

    @classmethod
    def make(cls, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
             page_size: int, num_pages: int) -> "Buckets":
        max_pages_seq = -(-max_model_len // page_size)
        # Pages of one step: never more than the pool holds, nor max_num_seqs full sequences.
        max_pages = max(min(num_pages - 1, max_num_seqs * max_pages_seq), 1)
        return cls(tokens=_pow2_range(min(MIN_TOKENS_BUCKET, max_num_batched_tokens), max_num_batched_tokens),
                   pages=_pow2_range(min(MIN_PAGES_BUCKET, max_pages), max_pages),
                   max_num_seqs=max_num_seqs, max_pages_seq=max_pages_seq, page_size=page_size)

    def logits_rows(self, tokens: int) -> int:
        return min(tokens, self.max_num_seqs)

    @property
    def history(self) -> tuple[int, ...]:
        """Token-history lengths of the logits processor (penalties): powers of 4 from 256,
        then the longest sequence (few shapes: they are compiled at warm-up too)."""
        longest = self.max_pages_seq * self.page_size
        out, h = [], 256
        while h < longest:
            out.append(h)
            h *= 4
        return tuple(out) + (longest,)

    def pick(self, options: Sequence[int], need: int, what: str) -> int:
        for v in options:
            if v >= need:
                return v
        raise ValueError(f"{what}={need} exceeds the largest compiled bucket {options[-1]}")

    def for_step(self, num_tokens: int, num_pages: int) -> tuple[int, int]:
        return (self.pick(self.tokens, num_tokens, "tokens in a step"),
                self.pick(self.pages, num_pages, "pages in a step"))

    def first_shapes(self, prompt_tokens: int = FIRST_PROMPT_TOKENS) -> list[tuple[int, int]]:
        """The (T, X) pairs a lone request of up to prompt_tokens prompt tokens lands on: its
        prefill in one step, then its decode steps until it holds twice its prompt's pages."""
        ps, most = self.page_size, self.pages[-1]
        out: set[tuple[int, int]] = set()
        for n in range(1, min(prompt_tokens, self.tokens[-1], self.max_pages_seq * ps) + 1):
            pages = min(-(-n // ps), most)
            out |= {self.for_step(n, pages), self.for_step(1, min(2 * pages, self.max_pages_seq, most))}
        return sorted(out)

    def all_shapes(self):
        """The (T, X) pairs a step can land on: X can't exceed what T tokens' sequences hold
        (at most T sequences of max_pages_seq pages) and can't be below what more than half of
        T tokens fill (a step lands on T only with more than T/2 tokens)."""
        prev_t = 0
        for t in self.tokens:
            lo = -(-(prev_t + 1) // self.page_size)
            hi = min(t, self.max_num_seqs) * self.max_pages_seq
            prev_x = 0
            for x in self.pages:
                if x >= lo and prev_x < hi:
                    yield (t, x)
                prev_x = x
            prev_t = t


@dataclasses.dataclass
class ProcessRow:
    """What the logits processor needs of one row (see multilora.engine.logits_process)."""

    token_ids: Sequence[int]             # prompt then output tokens
    num_prompt: int
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: Sequence[tuple[int, float]] = ()   # (token id, added to its logit)


@dataclasses.dataclass
class SampleRow:
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int = 0
    step: int = 0
    logprobs: bool = False
    process: Optional[ProcessRow] = None     # penalties / logit_bias / min_tokens, when asked
    matcher: Optional[Any] = None            # structured output: whose mask limits the next token
    draft: Sequence[int] = ()                # speculative: tokens drafted after the chunk's last (one row each)


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray                  # one per chunk
    logprobs: Optional[tuple] = None    # (chosen, top_ids, top_vals) per chunk, numpy
    # per chunk, where asked (prompt_next): (chosen_n, top_ids_nK, top_vals_nK) for its n tokens
    prompt_logprobs: Optional[list] = None
    # per chunk with a draft (else None): the tokens sampled at its 1 + len(draft) rows, and
    # their logprobs as logprobs has them
    spec: Optional[list] = None
    spec_logprobs: Optional[list] = None

    def row_logprobs(self, i: int, j: int = 0) -> Optional[tuple]:
        """(chosen, top_ids, top_vals) of chunk i's j-th row (j > 0: after its j-th draft)."""
        if self.logprobs is None:
            return None
        if j == 0:
            return tuple(a[i] for a in self.logprobs)
        return tuple(a[j] for a in self.spec_logprobs[i])


class ModelRunner:
    """Owns every device array (weights, KV cache, LoRA slots and their writer) and runs steps."""

    def __init__(self, cfg: ModelConfig, weights: Weights, kv: KVCache, lora: Optional[LoRASlots],
                 buckets: Buckets, lora_backend: str = "auto"):
        self.cfg, self.weights, self.kv, self.lora = cfg, weights, kv, lora
        self.buckets = buckets
        self.lora_backend = lora_backend
        # multilora's CPU kernels for decode shapes, where they can serve the slots (see `auto`)
        a = lora.weights.qkv_a_LUD if lora is not None else None
        self._native = (lora_backend == "auto" and a is not None
                        and native_usable(a.dtype, a.sharding.device_set))
        self._platform = next(iter(a.sharding.device_set)).platform if a is not None else "cpu"
        if lora_backend == "pallas" and a is not None and self._platform != "tpu":
            log.warning("lora_backend 'pallas' is a TPU kernel: on %s it runs in Pallas's interpreter, "
                        "many times slower (use auto)", self._platform)
        # decode attention through multilora's CPU kernel, where it can read this cache
        self.native_attention = native_attention_usable(kv.k_LPpKH)
        self.page_size = kv.page_size
        self.compiler = ShapeCompiler()   # every executable below, compiled once by whoever asks first
        self._step_specs: dict = {}       # (tokens, pages) -> the PackSpec its step was compiled for
        # The cache comes back in the format it went in: heads-major on a TPU (llama.KV_HEADS_MAJOR),
        # so the next step, compiled for it, reads it in place too.
        self.kv_heads_major = is_heads_major(kv.k_LPpKH)
        # a heads-major cache (a TPU's): decode-sized steps attend through the Pallas kernel (attention_for)
        self.pallas_attention = self.kv_heads_major and pallas_attention_on(kv.k_LPpKH)
        self.kv_write = kv_write_mode() if self.kv_heads_major else "rows"   # how its steps write K/V rows
        kv_shardings = kv_cache_formats(jax.tree.map(lambda a: a.sharding, kv), self.kv_heads_major)
        # Replicated over the cache's devices: the batch, the logits and the sampler's rows.
        self.replicated = _replicated_like(kv.k_LPpKH.sharding)
        # The step is compiled, like every jit here, for the layouts its committed arguments have: the LoRA
        # pools' is rows-major (multilora.adapters.pool.POOL_LAYOUT), so the step reads them in place.
        # The step's batch arrives as one int32 buffer (multilora.model.packing): one host -> device
        # copy a step, not one per array (~18 with LoRA), each of which a TPU step waits for.
        self._fwd = jax.jit(owned(forward_packed), static_argnames=("spec", "cfg", "backend", "hidden", "native_attention",
                                                             "kv_heads_major", "pallas_attention", "kv_write"),
                            donate_argnames=("kv",),
                            out_shardings=(self.replicated, kv_shardings, self.replicated))
        self._score = jax.jit(owned(token_logprobs), static_argnames=("cfg", "k"), out_shardings=self.replicated)
        # tokens padded to max_num_seqs: what the next step can take on the device (launch's feed)
        self._sample = jax.jit(functools.partial(sample, width=buckets.max_num_seqs),
                               static_argnames=("mode", "logprobs"), out_shardings=self.replicated)
        self._unfed = jax.device_put(np.zeros(buckets.max_num_seqs, np.int32), self.replicated)
        self._process = jax.jit(owned(process_logits), out_shardings=self.replicated)
        self._mask = jax.jit(owned(apply_token_bitmask), out_shardings=self.replicated)
        # structured output: fills the rows' token masks, (matcher, row) pairs -> bitmask_QW
        # (multilora.engine.structured.Grammars.fill); set by the engine
        self.fill_masks: Optional[Callable[[list, np.ndarray], None]] = None

    # ---- adapters in slots --------------------------------------------------------------------
    def write_slot(self, slot: int, rows, adapter) -> None:
        self.lora.load(slot, rows, adapter)

    def clear_slot(self, slot: int) -> None:
        self.lora.clear(slot)

    # ---- compilation -----------------------------------------------------------------------
    def backend_for(self, num_tokens: int) -> str:
        return choose_backend(self.lora_backend, num_tokens, num_tokens <= self.buckets.max_num_seqs,
                              self.lora.num_slots if self.lora is not None else None, self._native,
                              self._platform)

    def pallas_attention_for(self, num_tokens: int) -> bool:
        """Whether a step of num_tokens tokens attends through the Pallas kernel: on a TPU, every
        step (decode rows, prefill chunks and both). Its prefill side reads only the step's pages,
        whatever the cache holds; measured on a TPU v5e once its per-step plan was made before the
        layer loop (benchmarks/log/32-2026-12-06-tpu-v5e-packed-batch.md): a 512-token prefill at
        SmolLM2-135M's shape 5.8 ms either way, at Llama-3.2-1B's 10.5 against XLA's 11.8."""
        return self.pallas_attention

    def lora_batch_preparer(self, num_tokens: int):
        """What a step of num_tokens tokens builds its LoRABatchInfo with: slot_T -> info, through
        the backend backend_for(num_tokens) names (None without LoRA)."""
        if self.lora is None:
            return None
        name = self.backend_for(num_tokens)
        be = get_backend(name.split(SWITCH)[0])
        # A run-time switch: tiles sized for the step's few adapters, whatever the pool holds.
        # Otherwise tiles for as many adapters as a step can have: one per sequence, at most
        # max_num_seqs (a pool sized by memory holds hundreds of slots: tiles for all of them made
        # a 512-token prefill on a TPU 2.2x as long as tiles for 64;
        # benchmarks/log/22-2026-12-05-tpu-v5e-pool-by-memory.md).
        cap = grouped_cap(num_tokens) if SWITCH in name else self.buckets.max_num_seqs
        s, r, rows = self.lora.scalings_S, self.lora.ranks_S, self.lora.rows_SR
        return lambda slot_T: be.prepare_lora_batch(slot_T, s, r, rows, cap)

    def _dummy_batch(self, t, x):
        return build_batch([], num_tokens=t, num_pages=x, num_logits=self.buckets.logits_rows(t),
                           page_size=self.page_size, prepare_lora=self.lora_batch_preparer(t))

    def _abstract(self, tree):
        """Host arrays -> their shapes, replicated on the mesh: what the steps are compiled for.
        The calls then take the numpy arrays themselves, copied to every device (and under
        several processes, each process copies its own; jit trusts that they agree)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype,
                                                           sharding=self.replicated), tree)

    def _lower_step(self, key):
        t, x = key
        lora_w = self.lora.weights if self.lora is not None else None
        spec, _ = pack((self._dummy_batch(t, x), np.full(t, -1, np.int32)))
        self._step_specs[key] = spec
        return self._fwd.lower(self.weights, lora_w, self.kv, abstract_buffer(spec, self.replicated),
                               self._unfed, spec=spec, cfg=self.cfg, backend=self.backend_for(t), hidden=True,
                               native_attention=self.native_attention, kv_heads_major=self.kv_heads_major,
                               pallas_attention=self.pallas_attention_for(t), kv_write=self.kv_write)

    def _compiled_step(self, key):
        return self.compiler.get("step", key, self._lower_step)

    def _lower_sampler(self, key):
        rows, mode, logprobs = key
        z = np.zeros(rows, np.float32)
        zi = np.zeros(rows, np.int32)
        logits = jax.ShapeDtypeStruct((rows, self.cfg.vocab_size), jnp.float32, sharding=self.replicated)
        return self._sample.lower(logits, *self._abstract((z, zi, z, zi.astype(np.uint32), zi)),
                                  mode=mode, logprobs=logprobs)

    def _compiled_sampler(self, rows: int, mode: str, logprobs: bool):
        return self.compiler.get("sampler", (rows, mode, logprobs), self._lower_sampler)

    def _lower_processor(self, key):
        rows, hist = key
        v, k = self.cfg.vocab_size, MAX_BIAS_ENTRIES
        logits = jax.ShapeDtypeStruct((rows, v), jnp.float32, sharding=self.replicated)
        args = (np.zeros((rows, hist), np.int32), np.zeros((rows, hist), np.float32),
                np.zeros((rows, k), np.int32), np.zeros((rows, k), np.float32),
                np.zeros(rows, np.float32), np.zeros(rows, np.float32), np.zeros(rows, np.float32))
        return self._process.lower(logits, *self._abstract(args))

    def _compiled_processor(self, rows: int, hist: int):
        return self.compiler.get("logits-processor", (rows, hist), self._lower_processor)

    def _lower_scorer(self, tokens: int):
        x = jax.ShapeDtypeStruct((tokens, self.cfg.hidden_size), jnp.float32, sharding=self.replicated)
        return self._score.lower(self.weights, x, *self._abstract((np.zeros(tokens, np.int32),)),
                                 cfg=self.cfg, k=NUM_LOGPROBS)

    def _prompt_logprobs(self, x_TD, chunks: Sequence[SeqChunk], prompt_next: Sequence) -> list:
        """Each asking chunk's (chosen, top ids, top logprobs) for its tokens' next tokens."""
        t = x_TD.shape[0]
        next_T = np.zeros(t, np.int32)
        offsets, off = [], 0
        for c, nxt in zip(chunks, prompt_next):
            offsets.append(off)
            if nxt is not None:
                next_T[off:off + len(nxt)] = nxt
            off += len(c.token_ids)
        fn = self.compiler.get("prompt-logprobs", t, self._lower_scorer)
        chosen, top_ids, top_vals = (_host(a) for a in fn(self.weights, x_TD, next_T))
        return [None if nxt is None else (chosen[o:o + len(nxt)], top_ids[o:o + len(nxt)], top_vals[o:o + len(nxt)])
                for o, nxt in zip(offsets, prompt_next)]

    def _lower_masker(self, rows: int):
        logits = jax.ShapeDtypeStruct((rows, self.cfg.vocab_size), jnp.float32, sharding=self.replicated)
        return self._mask.lower(logits, *self._abstract((np.zeros((rows, mask_words(self.cfg.vocab_size)),
                                                                  np.int32),)))

    def _masked(self, logits, rows: Sequence[SampleRow]):
        """Logits of constrained rows with their disallowed tokens at -inf. The masks are built
        here, on the host, while the device still runs the step's forward (dispatched before)."""
        q, v = logits.shape
        bitmask_QW = allow_all(q, v)
        # a drafted chunk's rows are consecutive: row i + j masked after its first j drafts
        self.fill_masks([(r.matcher, i, list(r.draft)) for i, r in enumerate(rows)
                         if r.matcher is not None and (i == 0 or rows[i - 1].matcher is not r.matcher)], bitmask_QW)
        fn = self.compiler.get("token-mask", q, self._lower_masker)
        return fn(logits, bitmask_QW)

    def _processed(self, logits, rows: Sequence[SampleRow]):
        """Logits after each row's penalties and biases (rows without any pass unchanged)."""
        q, v = logits.shape
        need = [r.process for r in rows]
        longest = max(len(p.token_ids) for p in need if p is not None)
        h = self.buckets.pick(self.buckets.history, longest, "tokens of a penalized sequence")
        hist = np.full((q, h), v, np.int32)       # V: out of range, dropped
        is_out = np.zeros((q, h), np.float32)
        bias_ids = np.full((q, MAX_BIAS_ENTRIES), v, np.int32)
        bias = np.zeros((q, MAX_BIAS_ENTRIES), np.float32)
        presence, frequency = np.zeros(q, np.float32), np.zeros(q, np.float32)
        repetition = np.ones(q, np.float32)
        for i, p in enumerate(need):
            if p is None:
                continue
            ids = np.asarray(p.token_ids, np.int32)
            hist[i, :len(ids)] = ids
            is_out[i, p.num_prompt:len(ids)] = 1.0
            if p.bias:
                tok, val = zip(*p.bias)
                bias_ids[i, :len(tok)], bias[i, :len(tok)] = tok, val
            presence[i], frequency[i], repetition[i] = p.presence, p.frequency, p.repetition
        fn = self._compiled_processor(q, h)
        return fn(logits, hist, is_out, bias_ids, bias, presence, frequency, repetition)

    @property
    def num_compiled_steps(self) -> int:
        return len(self.compiler.table("step"))

    def compiled_steps(self) -> dict:
        """(tokens, pages) -> the compiled step executable, for every shape compiled so far (its
        HLO through .as_text(): what collectives a sharded step runs)."""
        return dict(self.compiler.table("step"))

    @property
    def warm(self) -> bool:
        """Every shape of the warm-up compiled (False without a warm-up)."""
        return self.compiler.warm

    @property
    def compiles(self) -> int:
        """Shapes compiled so far (warm-up, on first use and after the warm-up alike)."""
        return self.compiler.compiles

    @property
    def compiles_after_warmup(self) -> int:
        """Compiles of shapes outside the warm-up's plan since it began (missing buckets)."""
        return self.compiler.compiles_after_warmup

    def warmup_jobs(self) -> tuple[list, int]:
        """Every (what, key, lower) a warm-up compiles (the same set, whatever the order, as
        before warm-ups could run in the background), and how many lead the list as what a first
        short request needs: the steps a lone request lands on (Buckets.first_shapes) and the
        samplers of their rows, without logprobs. Then the other samplers, the other steps from
        the smallest, the logits processors, the token masks and the prompt scorers."""
        b = self.buckets
        every = list(b.all_shapes())
        first = [k for k in b.first_shapes() if k in every]
        rest = sorted((k for k in every if k not in first), key=lambda k: (k[0] * k[1], k))
        rows = sorted({b.logits_rows(t) for t in b.tokens})
        first_rows = sorted({b.logits_rows(t) for t, _ in first})
        samplers = [(r, m, False) for r in first_rows for m in ("greedy", "sample")]
        samplers += [(r, m, lp) for r in rows for m in ("greedy", "sample") for lp in (False, True)
                     if (r, m, lp) not in samplers]
        jobs = ([("step", k, self._lower_step) for k in first]
                + [("sampler", k, self._lower_sampler) for k in samplers]
                + [("step", k, self._lower_step) for k in rest]
                + [("logits-processor", (r, h), self._lower_processor) for r in rows for h in b.history]
                + [("token-mask", r, self._lower_masker) for r in rows]
                + [("prompt-logprobs", t, self._lower_scorer) for t in b.tokens])
        return jobs, len(first) + 2 * len(first_rows)

    def warmup(self, progress: bool = False, threads: Optional[int] = None, background: bool = False) -> float:
        """Compile every bucket (and run none): no compile happens after this. background: only
        what a first short request needs before returning, the rest on background threads
        (ShapeCompiler.start; `warmup_status()`, `wait_warm()`). The seconds spent here."""
        jobs, num_first = self.warmup_jobs()
        secs = self.compiler.start(jobs, num_first, background, progress=progress, threads=threads)
        if not background:
            log.info("compiled %d step shapes in %.1fs", self.num_compiled_steps, secs)
        return secs

    def warmup_status(self) -> dict:
        return self.compiler.status()

    def wait_warm(self, timeout: Optional[float] = None) -> bool:
        return self.compiler.wait(timeout)

    def stop_warmup(self) -> None:
        """A background warm-up's threads stop after their current compile (at shutdown)."""
        self.compiler.stop()

    def release(self) -> None:
        """Give back the device arrays and executables (Engine.shutdown): the warm-up stopped
        and waited for, the compiled shapes and jitted functions dropped, the weights, KV cache
        and adapter pools let go. The runner runs nothing after this."""
        self.stop_warmup()
        self.compiler.tables.clear()
        self._step_specs.clear()
        self._fwd = self._score = self._sample = self._process = self._mask = None
        self.weights = self.kv = self.lora = self._unfed = None

    # ---- a step ------------------------------------------------------------------------------
    def bucket_for(self, chunks: Sequence[SeqChunk]) -> tuple[int, int]:
        tokens = sum(len(c.token_ids) for c in chunks)
        pages = sum(pages_needed(c, self.page_size) for c in chunks)
        if len(chunks) > self.buckets.max_num_seqs:
            raise ValueError(f"{len(chunks)} sequences exceed max_num_seqs={self.buckets.max_num_seqs}")
        return self.buckets.for_step(tokens, pages)

    def execute(self, chunks: Sequence[SeqChunk], rows: Sequence[SampleRow],
                prompt_next: Optional[Sequence[Optional[Sequence[int]]]] = None) -> StepResult:
        """Run one mixed step (decode rows and prefill chunks together); sample one token per
        chunk, in the chunks' order (callers ignore those of unfinished prefill chunks).
        prompt_next: per chunk, None or the id that follows each of its tokens (any id where it
        does not matter): those chunks also get their tokens' logprobs (echo)."""
        return self.launch(chunks, rows, prompt_next).result()

    def launch(self, chunks: Sequence[SeqChunk], rows: Sequence[SampleRow],
               prompt_next: Optional[Sequence[Optional[Sequence[int]]]] = None,
               feed: Optional[Sequence[Optional[int]]] = None, after: Optional["Launched"] = None) -> "Launched":
        """execute, without waiting for the device: the step and its sampler are dispatched and
        the tokens stay on the device until Launched.result(). feed (with after, an earlier
        launch not yet read): per chunk, None or the index of a chunk of `after` whose sampled
        token is this chunk's last token; the token goes from one step to the next on the
        device, so the host can plan and send this step while `after` still runs (async
        scheduling). A fed chunk's own last token id is ignored."""
        order = decode_first(chunks)
        chunks = [chunks[i] for i in order]
        # one sample row per logits row: a drafted chunk's j-th row samples its output token j
        counts = np.asarray([c.num_logits for c in chunks], np.int64)
        firsts = np.cumsum(counts) - counts
        rows = [dataclasses.replace(rows[i], step=rows[i].step + j) if j else rows[i]
                for i, n in zip(order, counts) for j in range(n)]
        prompt_next = [prompt_next[i] for i in order] if prompt_next is not None else None
        key = self.bucket_for(chunks)
        fn = self._compiled_step(key)
        t, x = key
        batch = build_batch(chunks, num_tokens=t, num_pages=x, num_logits=self.buckets.logits_rows(t),
                            page_size=self.page_size, prepare_lora=self.lora_batch_preparer(t))
        src_T = np.full(t, -1, np.int32)   # which of `after`'s sampled tokens each token takes
        if feed is not None and any(f is not None for f in feed):
            ends = np.cumsum([len(c.token_ids) for c in chunks]) - 1
            for b, i in enumerate(order):
                if feed[i] is not None:
                    src_T[ends[b]] = after.row_of[feed[i]]
        lora_w = self.lora.weights if self.lora is not None else None
        spec, buf = pack((batch, src_T))
        if spec != self._step_specs[key]:
            raise AssertionError(f"step {key}: the batch's arrays differ from those it was compiled for")
        fed_M = after.tokens_M if after is not None else self._unfed
        logits, self.kv, x_TD = fn(self.weights, lora_w, self.kv, buf, fed_M)
        n = len(rows)
        greedy = all(row.temperature == 0.0 for row in rows)
        want_lp = any(row.logprobs for row in rows)
        q = logits.shape[0]
        temp = np.zeros(q, np.float32)
        top_k = np.full(q, -1, np.int32)
        top_p = np.ones(q, np.float32)
        seed = np.zeros(q, np.uint32)
        step = np.zeros(q, np.int32)
        for i, row in enumerate(rows):
            temp[i], top_k[i], top_p[i] = row.temperature, row.top_k, row.top_p
            seed[i], step[i] = np.uint32(row.seed & 0xFFFFFFFF), row.step
        if any(row.process is not None for row in rows):
            logits = self._processed(logits, rows + [SampleRow()] * (q - n))
        if any(row.matcher is not None for row in rows):
            logits = self._masked(logits, rows)
        sampler = self._compiled_sampler(q, "greedy" if greedy else "sample", want_lp)
        tokens_M, lp = sampler(logits, temp, top_k, top_p, seed, step)
        inverse = np.argsort(np.asarray(order, np.int64))  # back to the callers' order
        scored = None
        if prompt_next is not None and any(p is not None for p in prompt_next):
            scored = self._prompt_logprobs(x_TD, chunks, prompt_next)
            scored = [scored[i] for i in inverse]
        return Launched(tokens_M, lp, firsts[inverse], scored, counts[inverse])


@dataclasses.dataclass
class Launched:
    """A dispatched step: its sampled tokens (and logprobs) still on the device."""

    tokens_M: jax.Array              # sampled tokens in the step's row order, padded to max_num_seqs
    lp: Optional[tuple]              # (chosen, top_ids, top_vals) in the same order, or None
    row_of: np.ndarray               # the callers' chunk i -> its (first) row
    scored: Optional[list] = None    # prompt logprobs (echo), already on the host
    num_rows: Optional[np.ndarray] = None  # the callers' chunk i -> its rows (1 + its drafts)

    def result(self) -> StepResult:
        """Wait for the step; its tokens in the callers' order."""
        every = _host(self.tokens_M)
        lp_every = tuple(_host(a) for a in self.lp) if self.lp is not None else None
        lp = tuple(a[self.row_of] for a in lp_every) if lp_every is not None else None
        spec = spec_lp = None
        if self.num_rows is not None and (self.num_rows > 1).any():
            spans = [slice(r, r + n) if n > 1 else None for r, n in zip(self.row_of, self.num_rows)]
            spec = [every[s] if s is not None else None for s in spans]
            if lp_every is not None:
                spec_lp = [tuple(a[s] for a in lp_every) if s is not None else None for s in spans]
        return StepResult(every[self.row_of], lp, self.scored, spec, spec_lp)


def jit_slot_writer(write_rows, buffers, buffer_formats, rows_shardings, replicated, max_rank: int):
    """The LoRA pool writer (multilora.adapters.pool.write_rows) compiled now for one set of pools
    (so that the first adapter written after warm-up compiles nothing): donated, so rows are
    rewritten in place, and pinned to the pools' shardings and layout in and out (the new rows
    arrive split like the pools, the row ids replicated; a pool written back in the device's
    default layout would be converted whole by every step: multilora.adapters.pool.POOL_LAYOUT). One
    compile serves every adapter written `max_rank` rows wide (LoRASlots compiles one per
    write width, multilora.adapters.pool.write_widths): its row ids are traced (entries past its rank
    name the zero row); the rows come in the pools' dtype (host copies are read in it:
    multilora.adapters.adapter.load_adapter)."""
    from multilora.adapters.pool import blocks_of
    fn = jax.jit(owned(write_rows), donate_argnums=0, in_shardings=(buffer_formats, replicated, rows_shardings),
                 out_shardings=buffer_formats)
    rows_abstract = type(buffers)(**{
        k: jax.ShapeDtypeStruct((b.shape[0], blocks_of(k) * max_rank, b.shape[2]), b.dtype)
        for k, b in vars(buffers).items()})
    return fn.lower(buffers, jax.ShapeDtypeStruct((max_rank,), np.int32), rows_abstract).compile()


def owned(fn: Callable) -> Callable:
    """A new function object that calls fn, for jax.jit. JAX's caches key a jitted function's
    traces, lowerings and executables weakly on the function: those of a module-level function
    live as long as the process (a model served before, its executables still mapped: each XLA CPU
    executable holds memory mappings of its code, and a process that builds engines of several
    models one after another ran past the kernel's limit on mappings). Jitting a runner's own
    wrapper gives its executables the runner's lifetime."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*args, **kwargs)
    return call


def _replicated_like(s: jax.sharding.Sharding) -> jax.sharding.Sharding:
    if isinstance(s, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec())
    if len(s.device_set) == 1:
        return s
    raise TypeError(f"the KV cache must be placed with a NamedSharding (or on one device), got {s}")


def _host(a: jax.Array) -> np.ndarray:
    """A replicated result as numpy: this process's copy (under several processes the array also
    lives on devices this process cannot read; every copy is the same)."""
    return np.asarray(a.addressable_data(0))
