"""Step budgets (multilora.engine.step_budget): measured step costs by token bucket, the token
budget that keeps a step with decode rows within its target, and the scheduler under it. Plain
Python: a fake cost model (a line in the bucket's tokens), no jax, no model."""

from __future__ import annotations

import pytest

from multilora.config import EngineConfig
from multilora.engine.kv_pages import PagePool
from multilora.engine.request import RequestStatus
from multilora.engine.scheduler import Scheduler, SchedulerConfig
from multilora.engine.step_budget import (DEFAULT_FLOOR_S, DEFAULT_MIN_CHUNK, MIN_SAMPLES, StepBudget, StepClock,
                                         StepCosts, step_budget)
from tests.test_scheduler import req, rows, step

BUCKETS = (4, 8, 16, 32, 64, 128, 256, 512)


class LineCosts(StepCosts):
    """A fake cost model: a step padded to bucket b costs fixed + per_token * b seconds."""

    def __init__(self, fixed: float, per_token: float, buckets=BUCKETS):
        super().__init__(buckets)
        self.fixed, self.per_token = fixed, per_token

    def estimate(self, tokens):
        return self.fixed + self.per_token * self.bucket(tokens)


def test_costs_by_bucket_median_interpolated_unknown_above():
    c = StepCosts(BUCKETS)
    assert c.estimate(10) is None and c.measured() == {}
    assert [c.bucket(n) for n in (1, 4, 5, 64, 65, 512, 900)] == [4, 4, 8, 64, 128, 512, 512]
    for s in (0.10, 0.11):
        c.observe(20, s)
    assert c.measured() == {}                    # fewer than MIN_SAMPLES steps: not yet
    c.observe(20, 5.0)                           # a step that compiled does not move the median
    for _ in range(MIN_SAMPLES):
        c.observe(64, 0.30)
    assert c.measured() == {32: 0.11, 64: 0.30}
    assert c.estimate(32) == 0.11 and c.estimate(33) == 0.30
    assert c.estimate(4) == 0.11                 # below the measured: the smallest measured
    assert c.estimate(65) is None                # above: unknown
    for _ in range(MIN_SAMPLES):
        c.observe(256, 0.70)
    assert c.estimate(128) == pytest.approx(0.30 + (0.70 - 0.30) * (128 - 64) / (256 - 64))
    for _ in range(MIN_SAMPLES):
        c.observe(8, 0.5)                        # never less than a smaller bucket's estimate
    assert c.estimate(16) == 0.5 and c.estimate(32) == 0.5
    with pytest.raises(ValueError, match="buckets must be ascending positive token counts"):
        StepCosts((8, 4))


def test_measured_budget_grows_to_buckets_not_measured_yet():
    """A bucket above every measured one is allowed (it runs and is measured); once measured
    past the target, the budget stops below it."""
    c = StepCosts(BUCKETS)
    b = StepBudget(c, 512, target_itl_ms=100)
    for _ in range(MIN_SAMPLES):
        c.observe(8, 0.04)
    assert b.tokens_for(8) == 512
    for _ in range(MIN_SAMPLES):
        c.observe(128, 0.15)
    assert b.tokens_for(8) == 64                 # 64: interpolated 0.04 + 0.11 * 56 / 120 = 91 ms
    assert StepBudget(c, 512).tokens_for(8) == 32   # derived: max(2 x 40, 50) = 80 ms; 32: 62 ms, 64: 91 ms


def test_budget_keeps_a_step_with_decode_rows_within_the_target():
    costs = LineCosts(fixed=0.02, per_token=0.001)     # bucket b: 20 ms + 1 ms a token
    b = StepBudget(costs, 512, target_itl_ms=100)
    assert b.tokens_for(0) == 512                       # nothing decodes: no stream waits
    for rows_ in (1, 3, 8, 40, 64):
        n = b.tokens_for(rows_)
        assert n >= rows_ + DEFAULT_MIN_CHUNK
        assert n == max(64, rows_ + DEFAULT_MIN_CHUNK)  # 64 tokens: 84 ms; 128: 148 ms
        if n == 64:
            assert costs.estimate(n) <= 0.100 < costs.estimate(n + 1)
    # a target no step meets: the decode rows and the least chunk, so prompts still progress
    assert StepBudget(costs, 512, target_itl_ms=5).tokens_for(10) == 10 + DEFAULT_MIN_CHUNK
    assert StepBudget(costs, 40, target_itl_ms=5).tokens_for(30) == 40   # never past max_num_batched_tokens
    assert StepBudget(costs, 512, target_itl_ms=10_000).tokens_for(10) == 512
    # off, and not measured yet: max_num_batched_tokens alone
    assert StepBudget(costs, 512, target_itl_ms=0).tokens_for(10) == 512
    assert StepBudget(StepCosts(BUCKETS), 512, target_itl_ms=100).tokens_for(10) == 512


def test_derived_target_twice_a_decode_only_step_never_below_the_floor():
    slow = LineCosts(fixed=0.05, per_token=0.004)        # a slow CPU: bucket 64 is 306 ms
    b = StepBudget(slow, 512)
    assert b.target_for(64) == pytest.approx(2 * 0.306)
    assert b.tokens_for(64) == 128                        # 562 ms, where 256 would be 1074 ms
    assert b.target_for(2) == pytest.approx(max(2 * 0.066, DEFAULT_FLOOR_S))
    assert b.tokens_for(2) == 2 + DEFAULT_MIN_CHUNK       # 16 fit (114 ms within 132), but prompts progress
    fast = LineCosts(fixed=0.004, per_token=0.000005)    # a TPU: every bucket within 7 ms
    assert StepBudget(fast, 512).tokens_for(64) == 512   # never split: harmless there
    assert StepBudget(StepCosts(BUCKETS), 512).tokens_for(64) == 512


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "100", True])
def test_bad_targets_name_what_is_allowed(bad):
    with pytest.raises(ValueError, match=r"target_itl_ms must be a number of milliseconds > 0, 0 \(off"):
        EngineConfig(target_itl_ms=bad)
    with pytest.raises(ValueError, match="target_itl_ms must be"):
        StepBudget(StepCosts(BUCKETS), 512, bad)


def test_no_budget_when_off_or_over_several_processes():
    costs = StepCosts(BUCKETS)
    assert step_budget(costs, 512, 0) is None
    assert step_budget(costs, 512, 100, num_processes=2) is None   # each would plan by its own clock
    assert step_budget(costs, 512, None).tokens_for(3) == 512
    assert EngineConfig(target_itl_ms=0).target_itl_ms == 0 and EngineConfig().target_itl_ms is None


def test_clock_times_each_step_from_its_launch_or_the_previous_steps_end():
    costs = StepCosts(BUCKETS)

    class Plan:
        def __init__(self, n):
            self.num_tokens = n

    clock = StepClock(costs)
    for _ in range(MIN_SAMPLES):
        a, b = Plan(4), Plan(100)
        clock.launched(a)
        clock.launched(b)             # queued behind a (async scheduling)
        clock.done(a)
        clock.done(b)
        clock.done(Plan(8))           # never launched: not measured
    m = costs.measured()
    assert set(m) == {4, 128} and m[4] >= 0 and m[128] >= 0


def test_scheduler_splits_a_long_prompt_while_streams_decode():
    """Under a budget, a 300-token prompt arriving beside 3 decoding streams prefills in chunks
    that keep every step within the target by the cost model; without decode rows (or without a
    budget) it takes max_num_batched_tokens at once."""
    costs = LineCosts(fixed=0.02, per_token=0.001)
    budget = StepBudget(costs, 512, target_itl_ms=100)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=512), PagePool(400, 4), token_budget=budget.tokens_for)
    streams = [req(i, 5) for i in range(3)]
    for r in streams:
        s.add(r)
    first = step(s)
    assert first.num_tokens == 15                 # nothing decodes yet: all three prompts at once
    long_ = req(9, 300)
    s.add(long_)
    chunks = []
    while long_.status is RequestStatus.WAITING or long_.is_prefilling:
        plan = step(s)
        assert costs.estimate(plan.num_tokens) <= 0.100, rows(plan)
        assert [c.num_tokens for c in plan.chunks[:3]] == [1, 1, 1]   # every stream got its token
        chunks.append(next(c.num_tokens for c in plan.chunks if c.request is long_))
    assert chunks == [61] * 4 + [300 - 4 * 61] and all(len(r.output_token_ids) == 6 for r in streams)
    # the same without the streams: one chunk
    s2 = Scheduler(SchedulerConfig(max_num_batched_tokens=512), PagePool(400, 4), token_budget=budget.tokens_for)
    s2.add(req(9, 300))
    assert step(s2).num_tokens == 300
