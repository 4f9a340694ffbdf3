"""Engine: the Python API. add_request / step / generate / stream, and adapter management.

    engine = Engine(model="path/to/hf_checkpoint", lora_modules={"name": "path/to/adapter"})
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0.0), lora="name")

Options: an EngineConfig (multilora.config), or its fields as keyword arguments:

    Engine(model, config=EngineConfig(max_num_seqs=32))  ==  Engine(model, max_num_seqs=32)

One step is three calls: `plan = scheduler.schedule()` (decode rows and prefill chunks together,
pages and prefix-cache hits granted), `runner.execute(...)` (the runner owns every device array;
the plan's adapters are made resident in device slots first), `scheduler.postprocess(plan, ...)`
(tokens appended, full pages cached); then the engine checks stops, detokenizes and reports
deltas. One Request object carries a request's whole state. The engine is single-threaded; the
server drives it from one thread.

Around this core: build.py sizes what the engine is built with (KV pages, adapter slots and
pool, compilation cache), commands.py has its state changes as typed commands (replayed by the
followers of a multi-process engine), residency.py brings a step's adapters from disk into device
slots, outputs.py defines what it reports.

Several devices: `tensor_parallel_size=N` builds an N-device mesh and places weights, adapter
slots and the KV cache by the rules table (multilora.model.sharding). Several processes:
`distributed=dict(coordinator_address=..., num_processes=..., process_id=...)`; process 0 takes
the requests and the others call `follow()` (multilora.engine.distributed, docs/distributed.md).
"""

from __future__ import annotations

import itertools
import logging
import zlib
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from multilora.config import EngineConfig, ModelConfig
from multilora.engine import lifecycle
from multilora.engine.adapter_api import AdapterAPI, version_tag
from multilora.engine.batching import SeqChunk
from multilora.engine.build import default_max_rank, generation_eos, kv_cache_pages, kv_layout, lora_sizing, prepare_process
from multilora.engine.commands import AbortRequest, AddRequest, Command, StopFollowers
from multilora.engine.kv_pages import PagePool
from multilora.engine.outputs import (Logprob, PromptTooLongError, RequestOutput, StreamDelta,  # noqa: F401
                                      keep_prompt_logprobs, logprob_of, prompt_next_tokens)
from multilora.engine.residency import AdapterResidency
from multilora.engine.request import Request, SamplingParams, stop_after_token
from multilora.engine.runner import Buckets, Launched, ModelRunner, ProcessRow, SampleRow, StepResult
from multilora.engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from multilora.engine.speculative import make_speculator
from multilora.engine.step_budget import StepClock, StepCosts, step_budget
from multilora.engine.structured import Grammars
from multilora.engine.tokenizer import Detokenizer, load_tokenizer, prompt_token_ids
from multilora.model.loader import Progress
from multilora.adapters.adapter import load_adapter
from multilora.adapters.mix import MIX_PREFIX, read_mix
from multilora.adapters.loader import AdapterLoader
from multilora.adapters.registry import AdapterRegistry, public_name

log = logging.getLogger("multilora.engine")

Prompt = Union[str, Sequence[int]]


class Engine(AdapterAPI):
    def __init__(self, model: Optional[str] = None, lora_modules: Optional[dict[str, str]] = None,
                 config: Optional[EngineConfig] = None, *, warmup: Union[bool, str] = True, progress: bool = False,
                 buckets: Optional[Buckets] = None, distributed: Optional[dict] = None,
                 step_costs: Optional[StepCosts] = None, **options):
        import jax

        from multilora.engine.runner import jit_slot_writer
        from multilora.lora.backend import BACKEND_CHOICES
        from multilora.adapters.pool import LoRASlots, prepare_slot_layout
        from multilora.model import projections
        from multilora.model.llama import make_kv_cache
        from multilora.model.loader import load_weights, resolve_dtype
        from multilora.model.precision import activation_dtype, resolve_precision
        from multilora.model.sharding import KV_AXES, make_mesh, rules_for, sharding

        config = (config or EngineConfig()).replace(**options)
        self.config = c = config
        if c.lora_backend not in BACKEND_CHOICES:
            raise ValueError(f"unknown lora_backend {c.lora_backend!r}; choose one of {', '.join(BACKEND_CHOICES)}")
        lora_modules = dict(lora_modules or {})
        page_size = c.page_size
        prepare_process(c.compilation_cache_dir, distributed)  # the compilation cache, the kernels' build
        self._sync = None  # set at the end when several processes run
        self._shut_down = False
        if distributed:  # before anything touches a device
            from multilora.engine.distributed import initialize
            initialize(**distributed)
        if model is None:
            from multilora.default_model import default_model_dir
            model = str(default_model_dir())
        self.model_path = str(model)
        self.model_name = Path(model).name
        self.cfg = ModelConfig.from_dir(model)
        self.mesh = make_mesh(c.tensor_parallel_size, num_kv_heads=self.cfg.num_kv_heads)
        self.rules = rules_for(self.cfg, self.mesh)  # fails early if the heads do not divide
        # Read the adapters given at start before anything big: a bad one fails fast, and the
        # default max_lora_rank follows their ranks.
        max_lora_rank = c.max_lora_rank or default_max_rank(lora_modules, experts=bool(self.cfg.moe_layers))
        platform = jax.devices()[0].platform
        self.dtype = resolve_dtype(activation_dtype(c.dtype, platform))
        _, weights = load_weights(model, self.cfg, self.dtype, self.mesh, progress=progress)
        # what runs, by name (logged; /health reports it): dtype as asked, each part's dtype
        self.precision = resolve_precision(c.dtype, c.projection_dtype, c.lora_dtype, c.quantization,
                                           c.lora_backend, weights.embed_VD)
        self.projection_mode = self.precision.projections
        weights = projections.convert(weights, self.projection_mode)
        self.lora_dtype = np.dtype(resolve_dtype(self.precision.adapter_pool))
        log.log(*projections.describe(self.precision, weights.embed_VD))
        self.tokenizer = load_tokenizer(model)
        self.eos_token_ids = set(self.cfg.eos_token_ids) | generation_eos(model)

        self.max_model_len = int(c.max_model_len or self.cfg.max_position_embeddings)
        if self.max_model_len > self.cfg.max_position_embeddings:
            log.warning("max_model_len %d exceeds the model's max_position_embeddings %d",
                        self.max_model_len, self.cfg.max_position_embeddings)
        max_num_seqs = c.max_num_seqs
        max_num_batched_tokens = max(c.max_num_batched_tokens, 16)
        max_prefill_seqs = min(c.max_prefill_seqs, max_num_seqs)
        kv_heads_major, lane_pack = kv_layout(self.cfg, c, platform)
        kv_dtype = np.dtype(resolve_dtype(self.precision.kv_cache))
        num_pages = kv_cache_pages(self.cfg, c, self.max_model_len, kv_dtype, kv_heads_major, lane_pack)
        self.pages = PagePool(num_pages, page_size, enable_prefix_caching=c.enable_prefix_caching)
        # Split by KV heads (replicated when tp does not divide them), created in place.
        kv_sharding = sharding(self.mesh, self.rules, KV_AXES)
        kv = make_kv_cache(self.cfg, num_pages, page_size, kv_dtype, kv_sharding, kv_heads_major, lane_pack)

        self.lora_cfg = lora_sizing(self.cfg, c, self.lora_dtype, max_lora_rank, jax.devices()[0])
        max_loras_per_batch, pool_rows = self.lora_cfg.max_loras_per_batch, self.lora_cfg.pool_rows
        self.slots = (LoRASlots(self.cfg, self.lora_cfg, self.lora_dtype, self.mesh, jit_writer=jit_slot_writer)
                      if max_loras_per_batch > 0 else None)
        cfg = self.cfg  # not self: the loader's thread must not keep the engine alive
        # host copies in the pool's dtype: a bf16 pool's adapters are read, hashed, kept and written at half the bytes
        self.lora_host_dtype = host_dtype = np.dtype(self.lora_dtype)

        def read(name, path):
            if str(path).startswith(MIX_PREFIX):  # a weighted mix: rebuilt from its parts
                return read_mix(name, path, read)
            return load_adapter(name, path, cfg, max_lora_rank, host_dtype)

        self.registry = AdapterRegistry(max(max_loras_per_batch, 1), c.max_loaded_loras, read,
                                        max_host_bytes=int(c.lora_host_memory_gb * 2**30),
                                        num_rows=pool_rows, max_rank=max_lora_rank)
        table_width = self.lora_cfg.table_width

        def prepare(adapter):  # a waiting request's adapter, laid out for its slot write
            prepare_slot_layout(adapter, cfg, table_width)

        # host copies read off the engine thread
        self.loader = AdapterLoader(read, prepare if self.slots is not None else None)
        # `buckets` overrides the compiled shapes (e.g. a benchmark of a known workload); a step
        # outside them compiles on demand with a warning.
        self.buckets = buckets or Buckets.make(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len, page_size=page_size, num_pages=num_pages)
        # each step's tokens within a target inter-token latency, by the steps' measured costs
        self.step_costs = step_costs or StepCosts(self.buckets.tokens)
        self.step_budget = step_budget(self.step_costs, max_num_batched_tokens, c.target_itl_ms, jax.process_count())
        self._clock = StepClock(self.step_costs)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            max_prefill_seqs=max_prefill_seqs),
            self.pages, self.registry.fits, self._adapter_ready,
            self.step_budget.tokens_for if self.step_budget is not None else None)
        self.runner = ModelRunner(self.cfg, weights, kv, self.slots, self.buckets, c.lora_backend)
        self.residency = AdapterResidency(self.registry, self.loader, self.runner, self.scheduler,
                                          lambda req: self._finish(req, "error"))
        # structured output (llguidance), built on first use; a grammar ends on any EOS token
        self.grammars = (Grammars(self.tokenizer.to_json, self.cfg.vocab_size,
                                  sorted(t for t in self.eos_token_ids if 0 <= t < self.cfg.vocab_size))
                         if self.tokenizer is not None else None)
        self.runner.fill_masks = self.grammars.fill if self.grammars is not None else None
        self._requests: dict[str, Request] = {}
        self._finished_unreported: list[str] = []  # finished since the last step's deltas
        self._ids = itertools.count()
        self._arrival = itertools.count()
        self.seed = c.seed
        self.stats = {"steps": 0, "prefill_steps": 0, "decode_steps": 0, "mixed_steps": 0,
                      "preemptions": 0, "prompt_tokens": 0, "generated_tokens": 0, "overlapped_steps": 0}
        # Async scheduling: the next step is planned and sent while this one runs on the device
        # (its sampled tokens fed to the next on the device); default on an accelerator, where
        # the host's share of a step would otherwise be the chip's idle time.
        self.async_scheduling = (c.async_scheduling if c.async_scheduling is not None
                                 else jax.devices()[0].platform != "cpu")
        self._inflight: Optional[tuple[StepPlan, Launched]] = None  # dispatched, tokens not yet read
        # speculative decoding (multilora.engine.speculative): drafted decode rows verified in one step
        self.speculator = make_speculator(c.speculative_config, self.cfg, self.pages, num_pages, page_size, self.buckets,
                                          c.dtype, c.projection_dtype, max_num_batched_tokens, max_num_seqs)
        self._register_at_start(lora_modules, progress)
        if warmup not in (True, False, "background"):
            raise ValueError(f"warmup must be True, False or 'background', got {warmup!r}")
        if warmup:  # "background" (a server's): ModelRunner.warmup; several processes compile all first
            for r in filter(None, (self.runner, getattr(self.speculator, "drafter", None))):  # a draft model's too
                r.warmup(progress=progress, background=warmup == "background" and jax.process_count() == 1)
        # Several processes: from here on, state changes go through process 0 (every process
        # built the same engine from the same arguments up to this point).
        self._num_processes = jax.process_count()
        if self._num_processes > 1:
            from multilora.engine.distributed import StepSync
            self._sync = StepSync()
            self.async_scheduling = False  # the processes step in lockstep, each step read before the next
        lifecycle.watch(self)

    # ---- its end (multilora.engine.lifecycle) ---------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine's threads and give back its device arrays and executables; it takes
        no more work after this (EngineShutDownError). A second call does nothing."""
        lifecycle.shutdown(self)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        return prompt_token_ids(prompt, self.tokenizer, self.cfg.vocab_size, self.model_path)

    def _checked_prompt_ids(self, prompt: Prompt) -> list[int]:
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens; the context holds "
                                     f"{self.max_model_len} tokens (max_model_len={self.max_model_len}), leaving no room "
                                     "to generate")
        return ids

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                    lora: Optional[str] = None, request_id: Optional[str] = None,
                    follows: Optional[str] = None) -> str:
        """Queue a request; returns its id. follows: the id of another choice of the same prompt
        (n > 1), whose prefill this one waits for and then shares through the prefix cache."""
        params = params or SamplingParams()
        self._guard("add_request")
        ids = self._checked_prompt_ids(prompt)
        bad = [t for t, _ in params.logit_bias if t >= self.cfg.vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        if lora is not None and self.slots is None:
            raise ValueError("LoRA is disabled (max_loras_per_batch=0)")
        matcher = None
        if params.structured is not None:
            if self.grammars is None:
                raise ValueError(f"structured output needs the model's tokenizer.json, which {self.model_path!r} lacks")
            matcher = self.grammars.matcher(params.structured)  # ValueError if it does not compile
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora is not None:
            self.registry.acquire(lora)  # raises for unknown or unloading adapters
        arrival = next(self._arrival)
        req = Request(request_id=request_id, prompt_token_ids=ids, params=params,
                      arrival=arrival, adapter=lora, matcher=matcher)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
        if lora is not None:
            req.lora_hash = self.registry.entries[lora].content_hash
            req.lora_version = self.registry.entries[lora].version
        req.max_tokens = min(params.max_tokens, self.max_model_len - len(ids))
        # Derived from the arrival order, not the id (the server's ids are random): the same
        # requests in the same order repeat under the same engine seed.
        seed = params.seed if params.seed is not None else zlib.crc32(f"{self.seed}:{arrival}".encode())
        req.sample_seed = seed
        req.detok = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        lead = self._requests.get(follows) if follows is not None else None
        if lead is not None and self.pages.enable_prefix_caching and lead.prompt_token_ids == ids \
                and lead.adapter == lora and params.prompt_logprobs is None:
            req.follows = lead
        self._requests[request_id] = req
        self.scheduler.add(req)
        self.stats["prompt_tokens"] += len(ids)
        self._record(AddRequest(ids, params, lora, request_id, follows))
        return request_id

    def request(self, request_id: str) -> Optional[Request]:
        """A request's state (its tokens so far, status, pages), while the engine holds it: from
        add_request until its output is popped. Read it; the engine alone changes it."""
        return self._requests.get(request_id)

    def abort_request(self, request_id: str) -> bool:
        req = self._requests.get(request_id)
        if req is None or req.finished:
            return False
        self._guard("abort_request")
        self._record(AbortRequest(request_id))
        self._finish(req, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def _finish(self, req: Request, reason: str, stop_reason=None) -> None:
        if req.awaiting:  # finished before a dispatched step's token for it was read: drop that token
            req.output_token_ids.pop()
            req.awaiting = False
        self.scheduler.remove(req)
        req.finish_reason, req.stop_reason = reason, stop_reason
        self._finished_unreported.append(req.request_id)
        if req.adapter is not None:
            for slot in self.registry.release(req.adapter):
                self.runner.clear_slot(slot)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """One mixed step; returns what it added to each touched request (and finished ones).
        With async scheduling the step's tokens are read in the next call, after that call has
        planned and dispatched its own step: each call returns the previous step's deltas."""
        lifecycle.check_open(self, "step")
        if self._sync is not None and not self._sync.exchange(self):
            return []  # several processes, and the leader has stopped
        if self._sync is None:
            self.residency.fetch()
        self.loader.hold_background(self.scheduler.has_work)  # speculative reads wait for idle
        prev, self._inflight = self._inflight, None
        plan = self.scheduler.schedule()
        self.stats["preemptions"] += len(plan.preempted)
        prompt_next = [prompt_next_tokens(c) for c in plan.chunks]
        touched: list[str] = []
        if prev is not None and not (plan.chunks and self._overlaps(plan, prompt_next)):
            touched = self._read(*prev)  # this plan needs the host to know prev's tokens first
            prev = None
            kept = [i for i, c in enumerate(plan.chunks) if not c.request.finished]  # finished by those tokens
            plan.chunks = [plan.chunks[i] for i in kept]
            prompt_next = [prompt_next[i] for i in kept]
        if plan.chunks and self.speculator is not None:
            self.speculator.draft(plan)  # every token on the host now
        if plan.chunks:
            self.residency.make_resident(plan)
        if not plan.chunks:
            if self.scheduler.waiting and self.loader.in_flight() and not touched:
                self.loader.wait(0.05)  # every waiting request waits for a read: sleep, don't spin
            return self._collect(touched)  # still report aborts since the last step
        chunks = [SeqChunk(c.request.all_token_ids[c.start:c.start + c.num_tokens] + c.draft, c.start,
                           c.request.block_table, self.registry.slot_of(c.request.adapter), 1 + len(c.draft))
                  for c in plan.chunks]
        rows = [SampleRow(temperature=c.request.params.temperature, top_k=c.request.params.top_k,
                          top_p=c.request.params.top_p, seed=c.request.sample_seed,
                          step=len(c.request.output_token_ids),
                          logprobs=c.request.params.logprobs is not None,
                          process=self._process_row(c.request) if c.request.params.processes_logits else None,
                          matcher=c.request.matcher if c.completes_prefill else None, draft=c.draft)
                for c in plan.chunks]
        feed = None
        if prev is not None:  # a chunk ending on prev's pending token takes it on the device
            index = {id(c.request): i for i, c in enumerate(prev[0].chunks)}
            feed = [index.get(id(c.request)) if c.request.awaiting
                    and c.start + c.num_tokens == c.request.num_tokens else None for c in plan.chunks]
        overlap = self._overlaps(plan, prompt_next)
        # Reads no request waits for pause while the step runs (multilora.adapters.pacing).
        with self.loader.gate.closed():
            self._clock.launched(plan)
            launched = self.runner.launch(chunks, rows, prompt_next if any(p is not None for p in prompt_next)
                                          else None, feed=feed, after=prev[1] if prev is not None else None)
            prev_result = prev[1].result() if prev is not None else None  # prev's tokens, while this step runs
            if prev is not None:
                self._clock.done(prev[0])
            result = None if overlap else launched.result()
            if not overlap:
                self._clock.done(plan)
        if prev is not None:
            touched = self._take(prev[0], prev_result)
            self.stats["overlapped_steps"] += 1
        if overlap:
            deltas = self._collect(touched)  # before advance appends this step's pending tokens
            self.scheduler.advance(plan)
            self._inflight = (plan, launched)  # read in the next call, after it dispatches its step
            return deltas
        self.scheduler.advance(plan)
        return self._collect(touched + self._take(plan, result))

    def _overlaps(self, plan: StepPlan, prompt_next: list) -> bool:
        """Can the step after this plan be planned before this plan's tokens are read? Not where
        the host needs every token first: logits processors (penalties read the history),
        grammars (the next mask follows the token), prompt logprobs, drafts (looked up in the
        tokens); nor across processes."""
        return self.async_scheduling and not (self.speculator is not None and self.speculator.wants(plan)) and all(
            not c.request.params.processes_logits and c.request.matcher is None and p is None
            for c, p in zip(plan.chunks, prompt_next))

    def _read(self, plan: StepPlan, launched: Launched) -> list[str]:
        """Wait for an advanced plan's step and take its tokens (_take)."""
        with self.loader.gate.closed():
            result = launched.result()
        self._clock.done(plan)
        return self._take(plan, result)

    def _take(self, plan: StepPlan, result: StepResult) -> list[str]:
        """An advanced plan's tokens: pending tokens filled, logprobs, grammars fed, stops
        checked. Returns the ids of the requests that got a token."""
        if result.prompt_logprobs is not None:
            for c, scored in zip(plan.chunks, result.prompt_logprobs):
                if scored is not None:
                    keep_prompt_logprobs(c, scored)
        sampled = self.scheduler.resolve(plan, result.tokens, result.spec)
        if self.speculator is not None:
            self.speculator.record(plan)
        self.stats["steps"] += 1
        self.stats[f"{plan.kind}_steps"] += 1
        index = {id(c.request): i for i, c in enumerate(plan.chunks)}
        for req in sampled:
            i = index[id(req)]
            new = req.output_token_ids[len(req.output_token_ids) - 1 - plan.chunks[i].accepted:]
            del req.output_token_ids[-len(new):]  # a drafted row's tokens: appended and checked one by one
            for j, token in enumerate(new):
                req.output_token_ids.append(token)
                if result.logprobs is not None and req.params.logprobs is not None:
                    req.output_logprobs.append(logprob_of(token, *result.row_logprobs(i, j), req.params.logprobs))
                self.stats["generated_tokens"] += 1
                if req.matcher is not None and not req.matcher.consume_token(token):
                    req.error = f"structured output: {req.matcher.get_error() or 'the token does not fit the grammar'}"
                    self._finish(req, "error")
                    break
                self._check_stop(req)
                if req.finished:
                    break
        return [r.request_id for r in sampled]

    def _process_row(self, req: Request) -> ProcessRow:
        p = req.params
        bias = list(p.logit_bias)
        # no way to stop yet (unless a grammar is complete: it then allows only an EOS)
        if len(req.output_token_ids) < p.min_tokens and not (req.matcher is not None and req.matcher.is_accepting()):
            bias += [(t, -np.inf) for t in sorted(set(self.eos_token_ids) | set(p.stop_token_ids))
                     if 0 <= t < self.cfg.vocab_size]
        return ProcessRow(token_ids=req.all_token_ids, num_prompt=len(req.prompt_token_ids),
                          presence=p.presence_penalty, frequency=p.frequency_penalty,
                          repetition=p.repetition_penalty, bias=bias)

    def _adapter_ready(self, name: str) -> bool:
        # Several processes must schedule alike: there, reads stay in the step (synchronous)
        # rather than finishing at different times on different processes.
        return self._sync is not None or self.registry.ready(name)

    def _check_stop(self, req: Request) -> None:
        end = stop_after_token(req, self.eos_token_ids)
        if end is not None:
            self._finish(req, *end)

    def _collect(self, touched: list[str]) -> list[StreamDelta]:
        deltas = []
        # Only what this step touched or finished (an abort between steps too): no scan of
        # every live request. dict.fromkeys keeps the order and drops repeats.
        rids = dict.fromkeys([*touched, *self._finished_unreported])
        self._finished_unreported = []
        self.loader.hold_background(self.scheduler.has_work)  # idle again: the host tier fills
        for rid in rids:
            req = self._requests.get(rid)
            if req is None:  # popped or released already
                continue
            text = req.text
            if not req.finished and req.detok is not None:
                # hold back what could be the start of a stop string (the detokenizer already
                # holds back partial characters)
                hold = max((len(s) - 1 for s in req.params.stop), default=0)
                text = text[:max(req.sent_text, len(text) - hold)]
            first = req.sent_tokens == 0 and (req.output_token_ids or req.finished)
            d = StreamDelta(rid, req.output_token_ids[req.sent_tokens:], text[req.sent_text:],
                            req.finished, req.finish_reason,
                            req.output_logprobs[req.sent_logprobs:] if req.params.logprobs is not None else None,
                            num_cached_tokens=req.num_cached_tokens,
                            prompt_logprobs=list(req.prompt_logprobs)
                            if first and req.params.prompt_logprobs is not None else None,
                            lora_version=self._version_of(req))
            req.sent_tokens = len(req.output_token_ids)
            req.sent_text = max(req.sent_text, len(text))
            req.sent_logprobs = len(req.output_logprobs)
            if d.token_ids or d.text or d.finished:
                deltas.append(d)
        return deltas

    def pop_output(self, request_id: str) -> RequestOutput:
        """The final output of a finished request (and forget it)."""
        req = self._requests.pop(request_id)
        return RequestOutput(request_id, req.prompt_token_ids, list(req.output_token_ids), req.text,
                             req.finished, req.finish_reason, req.stop_reason, public_name(req.adapter),
                             list(req.output_logprobs) if req.params.logprobs is not None else None,
                             req.error, req.num_cached_tokens,
                             list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None,
                             self._version_of(req))

    @staticmethod
    def _version_of(req: Request) -> Optional[str]:
        return None if req.adapter is None else version_tag(req.lora_version, req.lora_hash)

    def release_finished(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None and req.finished:
            del self._requests[request_id]

    # ---- offline -----------------------------------------------------------------------------
    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 lora: Union[str, None, Sequence[Optional[str]]] = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the order of the prompts. Every prompt is
        checked before any is queued, so a bad one leaves the engine untouched."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        n = len(prompts)
        params_list = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * n
        lora_list = list(lora) if isinstance(lora, (list, tuple)) else [lora] * n
        if len(params_list) != n or len(lora_list) != n:
            raise ValueError(f"got {n} prompts but {len(params_list)} sampling params and "
                             f"{len(lora_list)} adapter names")
        for name in set(lora_list) - {None}:
            self.registry.resolve(name)
        prompt_ids = [self._checked_prompt_ids(p) for p in prompts]  # all checked before any is queued
        ids = [self.add_request(p, sp, l) for p, sp, l in zip(prompt_ids, params_list, lora_list)]
        pending = set(ids)
        bar = Progress(n, "generating", progress)
        while pending:
            done = {d.request_id for d in self.step() if d.finished} & pending  # each reported once
            if done:
                bar.update(len(done))
                pending -= done
        return [self.pop_output(rid) for rid in ids]

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None,
               lora: Optional[str] = None) -> Iterator[StreamDelta]:
        """Drive the engine and yield this request's increments (single-threaded use)."""
        rid = self.add_request(prompt, params, lora)
        try:
            while True:
                for d in self.step():
                    if d.request_id == rid:
                        yield d
                        if d.finished:
                            return
        finally:
            self.abort_request(rid)
            self.release_finished(rid)

    # ---- several processes ------------------------------------------------------------------
    def _guard(self, what: str) -> None:
        """Before a state change: on a multi-process engine only the leader (or a follower
        replaying the leader's command) may make one."""
        lifecycle.check_open(self, what)
        if self._sync is not None:
            self._sync.guard(what)

    def _record(self, cmd: Command) -> None:
        """After a state change succeeded: the followers replay it (multilora.engine.commands)."""
        if self._sync is not None:
            self._sync.record(cmd)

    @property
    def is_leader(self) -> bool:
        """Whether this process takes requests (always, with one process)."""
        return self._sync is None or self._sync.leader

    def follow(self) -> None:
        """On process > 0 of a multi-process engine: mirror the leader's steps (same requests,
        same batches, same collectives) until it calls stop_followers()."""
        if self.is_leader:
            raise RuntimeError("follow() is for processes other than 0; process 0 takes the requests")
        while self._sync.running:
            self.step()
            # Nobody reads a follower's outputs: forget finished requests (host bookkeeping only).
            for rid in [r for r, req in self._requests.items() if req.finished]:
                del self._requests[rid]
        self._sync.stop_barrier()

    def stop_followers(self) -> None:
        """On process 0: let the other processes' follow() return (after their last step)."""
        if self._sync is not None and self._sync.leader and self._sync.running:
            self._sync.record(StopFollowers())
            self._sync.exchange(self)
            self._sync.stop_barrier()

    @property
    def num_processes(self) -> int:
        """JAX processes running this engine together (1 without jax.distributed)."""
        return self._num_processes

    def watch_peers(self, on_lost) -> None:
        """Several processes: on_lost(message) is called, from a watchdog thread, once another
        process is gone (no heartbeat for a while). The default: a follower exits, the leader
        only logs (its next collective then raises)."""
        if self._sync is not None:
            self._sync.watch(on_lost)
