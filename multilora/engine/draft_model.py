"""A draft model for speculative decoding (vLLM's speculative_config method "draft_model"): a
smaller model with the target's vocabulary, run greedily for k tokens to propose each decode
row's drafts, which the target verifies in its step as it verifies the n-gram lookup's
(multilora.engine.speculative: the drafts never change what is sampled, only how many tokens a
step gives).

    drafter = DraftModel.build(path, target_cfg, num_pages, page_size, dtype, projection_dtype, buckets)
    drafts = drafter.propose([(request, room), ...])   # up to `room` greedy tokens per request

The draft has its own weights, runner (its own compiled shapes: the target's buckets) and KV
cache, of as many pages as the target's and read through the target's block tables: a
sequence's draft K/V live at the same page and offset as its target K/V, so the draft needs no
page bookkeeping of its own (the Speculator grants the pages its writes past the sequence need).
What it has computed is kept per request (how many leading positions hold its K/V, and the
pages they lie in); a request it has not seen, whose pages changed (preempted, recomputed) or
that it skipped, is caught up from where its draft K/V stop: the first of the k draft steps
computes each row's missing tokens as one chunk (as much as the step's tokens allow; a row
that does not fit catches up in part and drafts in a later step), the other k - 1 one token per
row. Pages shared through the prefix cache are rewritten with the same values (the same model
on the same tokens at the same positions). The draft runs without adapters: an adapter's rows
get the base draft's guesses, verified by the target with the adapter.
"""

from __future__ import annotations

import logging
from typing import Sequence

from multilora.engine.batching import SeqChunk
from multilora.engine.runner import Buckets, ModelRunner, SampleRow

log = logging.getLogger("multilora.draft")


class DraftModel:
    def __init__(self, runner: ModelRunner, page_size: int):
        self.runner = runner
        self.page_size = page_size
        # request id -> (positions whose draft K/V are in the cache, the pages they lie in, the
        # request's preemptions then)
        self._done: dict[str, tuple[int, tuple[int, ...], int]] = {}

    @classmethod
    def build(cls, path: str, target_cfg, num_pages: int, page_size: int, dtype: str, projection_dtype: str,
              buckets: Buckets) -> "DraftModel":
        """Load the draft (one device), its cache shaped as the target's pages. Raises ValueError
        when its vocabulary differs from the target's."""
        import jax

        from multilora.config import ModelConfig
        from multilora.model import projections
        from multilora.model.llama import make_kv_cache
        from multilora.model.loader import load_weights
        from multilora.model.precision import activation_dtype, resolve_precision
        from multilora.model.sharding import KV_AXES, make_mesh, rules_for, sharding

        if jax.process_count() > 1:
            raise ValueError("speculative_config: method 'draft_model' runs in one process (this engine has "
                             f"{jax.process_count()}); use 'ngram'")
        cfg = ModelConfig.from_dir(path)
        if cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"speculative_config: the draft model {path} has a vocabulary of {cfg.vocab_size} "
                             f"tokens, the target {target_cfg.vocab_size}: a draft must share the target's tokenizer")
        mesh = make_mesh(1, num_kv_heads=cfg.num_kv_heads)
        # the target's dtype as asked, resolved as the target's is (a draft has no adapters)
        _, weights = load_weights(path, cfg, activation_dtype(dtype, jax.devices()[0].platform), mesh)
        precision = resolve_precision(dtype, projection_dtype, "auto", None, "auto", weights.embed_VD)
        mode = precision.projections
        weights = projections.convert(weights, mode)
        kv_dtype = precision.kv_cache
        kv = make_kv_cache(cfg, num_pages, page_size, kv_dtype, sharding(mesh, rules_for(cfg, mesh), KV_AXES),
                           heads_major=False)
        log.info("draft model %s: %d layers, projections %s (%s)", path, cfg.num_layers, mode,
                 jax.devices()[0].platform)
        return cls(ModelRunner(cfg, weights, kv, None, buckets), page_size)

    def warmup(self, progress: bool = False, background: bool = False) -> float:
        """Compile the draft's step shapes and its greedy samplers (all it runs), as the target's
        warm-up does its own: the first request's shapes now, with background the rest behind."""
        jobs, num_first = self.runner.warmup_jobs()
        first = {key for _, key, _ in jobs[:num_first]}
        jobs = [j for j in jobs if j[0] == "step" or (j[0] == "sampler" and j[1][1:] == ("greedy", False))]
        return self.runner.compiler.start(jobs, sum(key in first for _, key, _ in jobs), background, progress)

    def _caught_up(self, req) -> int:
        """How many leading positions of req hold its draft K/V (0: catch up from the start)."""
        done, pages, preempted = self._done.get(req.request_id, (0, (), 0))
        return done if preempted == req.num_preemptions and tuple(req.block_table[:len(pages)]) == pages else 0

    def _note(self, req, done: int) -> None:
        self._done[req.request_id] = (done, tuple(req.block_table[:-(-done // self.page_size)]), req.num_preemptions)

    def propose(self, items: Sequence[tuple[object, int]]) -> list[list[int]]:
        """Greedy drafts: for each (request, room), up to room tokens after its tokens ([] for a
        row still catching up). The request's pages must hold len(tokens) + room - 1 positions."""
        budget = self.runner.buckets.tokens[-1]
        rows = self.runner.buckets.max_num_seqs
        if len(self._done) > 4 * rows:  # finished requests' states: keep only this step's
            live = {req.request_id for req, _ in items}
            self._done = {rid: v for rid, v in self._done.items() if rid in live}
        chunks, drafting = [], []
        for i, (req, room) in enumerate(items):
            tokens = req.all_token_ids
            n = len(tokens)
            start = min(self._caught_up(req), n - 1)
            take = min(n - start, budget)
            if take <= 0 or rows <= 0:
                break
            chunks.append(SeqChunk(tokens[start:start + take], start, req.block_table, 0))
            budget -= take
            rows -= 1
            self._note(req, start + take)  # its K/V written up to there (drafts' positions not counted)
            if take == n - start and room > 0:
                drafting.append((i, len(chunks) - 1))
        out: list[list[int]] = [[] for _ in items]
        if not drafting:
            if chunks:  # catching up only
                self.runner.execute(chunks, [SampleRow()] * len(chunks))
            return out
        tokens = self.runner.execute(chunks, [SampleRow()] * len(chunks)).tokens
        for i, c in drafting:
            out[i].append(int(tokens[c]))
        for j in range(1, max(items[i][1] for i, _ in drafting)):
            step = [i for i, _ in drafting if items[i][1] > j]
            if not step:
                break
            chunks = [SeqChunk([out[i][-1]], len(items[i][0].all_token_ids) + j - 1, items[i][0].block_table, 0)
                      for i in step]
            tokens = self.runner.execute(chunks, [SampleRow()] * len(chunks)).tokens
            for i, t in zip(step, tokens):
                out[i].append(int(t))
        return out

