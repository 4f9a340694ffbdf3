"""Speculative decoding by n-gram lookup (prompt lookup), exact for every adapter. Plain Python and
numpy, no jax.

    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4), pages, max_step_tokens, max_num_seqs)
    speculator.draft(plan)      # after scheduling: drafts for the plan's decode rows, pages granted
    ...                         # the step computes each drafted row as 1 + len(draft) tokens, with
                                # logits (and a sampled token) at every one of its positions
    scheduler.resolve(plan, tokens, spec)   # drafts accepted while they equal the sampled tokens
    speculator.record(plan)     # vllm:spec_decode_* counters

Drafting: the tokens that followed the latest earlier occurrence of the sequence's last n tokens
(prompt and output together), for n from prompt_lookup_max down to prompt_lookup_min (vLLM's
"ngram" method). Nothing to run on the device, and no second model: a drafted row is verified in
the step that would have computed its next token anyway, as a chunk of 1 + k tokens.

Verification keeps the target distribution exactly. Rejection sampling with the draft as a
point-mass proposal accepts draft d with probability p(d) and otherwise draws from p without d;
that is the same as drawing x ~ p at the position and accepting d iff x == d (P(accept) = p(d),
and a rejected x is distributed as p restricted to tokens other than d). So every position draws
its token as a step without speculation would: the sampler's own draw with the request's key for
that output index (fold_in(PRNGKey(seed), index)), greedy rows their argmax, structured rows under
the grammar's mask after the drafts before it. The drafts equal to those tokens are accepted up to
the first that is not; that position's token follows them (all accepted: the last position's, a
bonus token). A seeded request therefore gets the tokens it gets without speculation: on the CPU's
default path a position's logits are the same bits in a verify chunk as in a decode step (docs/engine.md,
"A token's numbers do not depend on its step"); elsewhere up to the float sums of another step
shape. The K/V written for rejected drafts lies beyond the
request's computed tokens: never attended (the causal mask is by position), rewritten later.

With method "draft_model" the drafts come from a smaller model instead (multilora.engine.draft_model,
handed in as `drafter`): its rows' room and pages are settled first (it writes K/V up to the last
draft's position), then it proposes for all of them together; the verification is the same.

Steps aside (the never-a-loss rule, docs/engine.md "Speculative decoding"): drafts are added only
while the step, drafts included, computes at most max_step_tokens tokens (its time is nearly flat
below that), never past the step's logits rows (max_num_seqs: the compiled shapes stay the
warm-up's) nor into pages holding cached prefixes, and not for rows that need the host between
tokens (penalties, logit_bias, min_tokens) or that ask for prompt logprobs.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from multilora.config import SpeculativeConfig
from multilora.engine.kv_pages import PagePool
from multilora.engine.scheduler import ScheduledChunk, StepPlan


def propose_ngram(tokens: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of tokens' last n tokens, for
    the largest n in [lookup_min, lookup_max] that occurs earlier; [] when none does."""
    t = np.asarray(tokens, np.int64)
    size = len(t)
    for n in range(min(lookup_max, size - 1), lookup_min - 1, -1):
        # windows t[i:i+n] with a token after them, the suffix's own window excluded
        windows = np.lib.stride_tricks.sliding_window_view(t[:size - 1], n)
        hits = np.flatnonzero((windows == t[size - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return t[start:start + k].tolist()
    return []


def make_speculator(cfg: Optional[SpeculativeConfig], model_cfg, pages: PagePool, num_pages: int, page_size: int,
                    buckets, dtype, projection_dtype, max_num_batched_tokens: int,
                    max_num_seqs: int) -> "Optional[Speculator]":
    """The engine's Speculator for its speculative_config (None: off); method "draft_model"
    builds the draft model (its own runner, over the target's pages)."""
    if cfg is None:
        return None
    drafter = None
    if cfg.method == "draft_model":
        from multilora.engine.draft_model import DraftModel
        drafter = DraftModel.build(cfg.model, model_cfg, num_pages, page_size, dtype, projection_dtype, buckets)
    return Speculator(cfg, pages, max_num_batched_tokens, max_num_seqs, drafter)


class Speculator:
    """Drafts for a plan's decode rows under the never-a-loss rule, and the counters."""

    def __init__(self, cfg: SpeculativeConfig, pages: PagePool, max_num_batched_tokens: int, max_num_seqs: int,
                 drafter=None):
        self.cfg = cfg
        self.pages = pages
        # method "draft_model": its propose([(request, room)]) -> drafts (multilora.engine.draft_model)
        self.drafter = drafter
        self.max_step_tokens = min(cfg.max_step_tokens, max_num_batched_tokens)
        self.max_rows = max_num_seqs  # the logits rows a step has (Buckets.logits_rows)
        k, lo, hi = cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max
        # tokens -> draft; replaceable (tests give oracle or wrong drafts)
        self.propose: Callable[[Sequence[int]], list[int]] = lambda tokens: propose_ngram(tokens, k, lo, hi)
        # vLLM's counters (vllm:spec_decode_*), and accepted drafts by position
        self.stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.accepted_per_pos = [0] * k

    @staticmethod
    def _may_draft(c: ScheduledChunk) -> bool:
        p = c.request.params
        return c.num_tokens == 1 and c.completes_prefill and not p.processes_logits and p.prompt_logprobs is None

    def steps_aside(self, plan: StepPlan) -> bool:
        """The never-a-loss rule: no drafts in a step this large."""
        b = self.cfg.disable_by_batch_size
        return plan.num_tokens >= self.max_step_tokens or (b is not None and len(plan.chunks) >= b)

    def wants(self, plan: StepPlan) -> bool:
        """Might this plan carry drafts? Then it steps in sync: a draft is looked up in the
        request's tokens, which must all be on the host (async scheduling's pending tokens read)."""
        if any(c.draft for c in plan.chunks):
            return True
        return not self.steps_aside(plan) and any(self._may_draft(c) for c in plan.chunks)

    def draft(self, plan: StepPlan) -> None:
        """Set each eligible decode chunk's draft (oldest rows first) and grant its pages."""
        if self.steps_aside(plan):
            return
        budget = self.max_step_tokens - plan.num_tokens
        rows = self.max_rows - len(plan.chunks)
        chosen = []  # a draft model's rows: (chunk, room), proposed together
        for c in plan.chunks:
            if budget <= 0 or rows <= 0:
                break
            req = c.request
            if not self._may_draft(c) or req.awaiting:
                continue
            room = min(self.cfg.num_speculative_tokens, budget, rows, req.max_tokens - len(req.output_token_ids) - 1)
            first = c.start + c.num_tokens  # the first draft's position
            if self.drafter is not None:
                # pages first: the draft model writes its K/V up to the last draft's position
                room = self._room_in_pages(req, first, room) if room > 0 else 0
                if room > 0:
                    chosen.append((c, room))
                    budget -= room
                    rows -= room
                continue
            d = self._grammar_cut(req, self.propose(req.all_token_ids)[:room] if room > 0 else [])
            d = d[:self._room_in_pages(req, first, len(d))]
            if d:
                c.draft = [int(t) for t in d]
                budget -= len(d)
                rows -= len(d)
        if chosen:
            for (c, _), d in zip(chosen, self.drafter.propose([(c.request, room) for c, room in chosen])):
                d = self._grammar_cut(c.request, d)
                if d:
                    c.draft = [int(t) for t in d]

    @staticmethod
    def _grammar_cut(req, d) -> list:
        """d up to the first token the request's grammar refuses (such drafts could never be accepted)."""
        if d and req.matcher is not None:
            return list(d[:int(req.matcher.validate_tokens(list(d)))])
        return list(d)

    def _room_in_pages(self, req, first: int, n: int) -> int:
        """How many of n tokens from position `first` the request's pages hold, grown from free
        pages (never a cached prefix's) as far as they go."""
        ps = self.pages.page_size
        if n and first + n > len(req.block_table) * ps:
            extra = min(self.pages.pages_for(first + n) - len(req.block_table), self.pages.num_free_uncached)
            n = max(0, min(n, (len(req.block_table) + extra) * ps - first))
            if n:
                self.pages.grow(req.block_table, first + n)
        return n

    def record(self, plan: StepPlan) -> None:
        """Count the plan's drafts and accepted tokens (after scheduler.resolve)."""
        for c in plan.chunks:
            if c.draft:
                self.stats["num_drafts"] += 1
                self.stats["num_draft_tokens"] += len(c.draft)
                self.stats["num_accepted_tokens"] += c.accepted
                for j in range(c.accepted):
                    self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> Optional[float]:
        n = self.stats["num_draft_tokens"]
        return self.stats["num_accepted_tokens"] / n if n else None
