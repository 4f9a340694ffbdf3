"""How many tokens a step may carry so that decode streams keep their inter-token latency while
prompts arrive: each step's prefill tokens budgeted from measured step costs. Plain Python, no jax.

A step that carries decode rows (running streams, one token each) and a long prefill chunk makes
every stream wait for the chunk: on a 2-core AVX2 host a 512-token chunk takes about a second,
and each stream's next token with it. The scheduler asks `StepBudget.tokens_for(decode_rows)` for
the step's token budget (decode rows included) before it plans:

- no decode rows (only prompts): `max_num_batched_tokens`, no stream waits;
- else the largest compiled token bucket whose measured cost is within the target, at least the
  decode rows plus `min_chunk` prefill tokens (prompts always progress), at most
  `max_num_batched_tokens`;
- target: `target_itl_ms` where given; derived (None): `factor` (2) times the measured cost of the
  step's decode rows alone, and no less than `floor_s` (50 ms): a stream's token comes at most
  about twice as late as without arrivals, and prefill gets about half of each step. On a fast
  host (a TPU's steps of a few ms; a CPU with few rows) a step within 50 ms is never split
  further; on a slow one the chunks shrink to what the target holds.
- nothing measured yet: `max_num_batched_tokens` (as without a budget); `target_itl_ms=0`: off.
  A step is measured from its launch to its result (StepClock) and the engine keeps no
  budget where several processes step in lockstep (each would plan by its own clock).

`StepCosts` keeps the measured seconds of the recent steps by token bucket (the shape a step is
padded to and compiled for, so what it costs): the median of each bucket's last few steps, once
it has `MIN_SAMPLES` (a step that compiled, or ran beside a disk read, does not move it); a
bucket between measured ones interpolated, one below them costing the smallest measured, one
above the largest measured unknown: allowed, so that it runs and is measured (no guess that
would split a fast host's steps, or let a slow host's grow).
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from typing import Optional, Sequence

from multilora.config import check_target_itl_ms

DEFAULT_FACTOR = 2.0       # derived target: this many times a decode-only step's measured cost
DEFAULT_FLOOR_S = 0.050    # derived target: never below this
DEFAULT_MIN_CHUNK = 16     # prefill tokens a step with decode rows may always carry
SAMPLES_PER_BUCKET = 8     # a bucket's recent steps kept
MIN_SAMPLES = 3            # a bucket's steps measured before its median counts


class StepCosts:
    """Measured step seconds by token bucket (`buckets`: the compiled token counts, ascending)."""

    def __init__(self, buckets: Sequence[int], samples: int = SAMPLES_PER_BUCKET):
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be ascending positive token counts, got {list(buckets)!r}")
        self.buckets = tuple(int(b) for b in buckets)
        self._seen: dict[int, deque] = {b: deque(maxlen=samples) for b in self.buckets}

    def bucket(self, tokens: int) -> int:
        """The bucket a step of `tokens` tokens is padded to (the largest for more)."""
        i = bisect.bisect_left(self.buckets, tokens)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds >= 0:
            self._seen[self.bucket(tokens)].append(float(seconds))

    def measured(self) -> dict[int, float]:
        """bucket -> the median of its recent steps' seconds, for the buckets measured
        MIN_SAMPLES times or more."""
        return {b: statistics.median(s) for b, s in self._seen.items() if len(s) >= MIN_SAMPLES}

    def estimate(self, tokens: int) -> Optional[float]:
        """Seconds a step of `tokens` tokens is expected to take, never less than a smaller
        bucket's; None where not known (above every measured bucket, or nothing measured)."""
        known = self.measured()
        b = self.bucket(tokens)
        below = [(k, v) for k, v in sorted(known.items()) if k <= b]
        above = [(k, v) for k, v in sorted(known.items()) if k >= b]
        if not above:
            return None
        floor = max((v for _, v in below), default=0.0)
        if b in known:
            return max(known[b], floor)
        if not below:  # below every measured bucket: costs no more than the smallest measured
            return above[0][1]
        (k0, v0), (k1, v1) = below[-1], above[0]
        return max(v0 + (v1 - v0) * (b - k0) / (k1 - k0), floor)


class StepBudget:
    """The token budget of a step with a given number of decode rows (module docstring)."""

    def __init__(self, costs: StepCosts, max_tokens: int, target_itl_ms: Optional[float] = None,
                 factor: float = DEFAULT_FACTOR, floor_s: float = DEFAULT_FLOOR_S,
                 min_chunk: int = DEFAULT_MIN_CHUNK):
        check_target_itl_ms(target_itl_ms)
        if not factor >= 1 or not floor_s >= 0 or not (isinstance(min_chunk, int) and min_chunk >= 1):
            raise ValueError(f"factor must be >= 1, floor_s >= 0 and min_chunk a positive integer, "
                             f"got {factor!r}, {floor_s!r}, {min_chunk!r}")
        self.costs = costs
        self.max_tokens = int(max_tokens)
        self.target_s = None if target_itl_ms is None else target_itl_ms / 1000.0
        self.factor, self.floor_s, self.min_chunk = factor, floor_s, min_chunk

    @property
    def enabled(self) -> bool:
        return self.target_s != 0

    def target_for(self, decode_rows: int) -> Optional[float]:
        """The seconds a step with these decode rows should stay within (None: not known yet)."""
        if self.target_s is not None:
            return self.target_s
        alone = self.costs.estimate(decode_rows)
        return None if alone is None else max(self.factor * alone, self.floor_s)

    def tokens_for(self, decode_rows: int) -> int:
        """Tokens (decode rows included) a step with `decode_rows` decode rows may carry."""
        if not self.enabled or decode_rows <= 0:
            return self.max_tokens
        target = self.target_for(decode_rows)
        if target is None or self.costs.estimate(decode_rows) is None:  # nothing measured yet
            return self.max_tokens
        fits = 0
        for b in self.costs.buckets:
            cost = self.costs.estimate(b)
            if b > self.max_tokens or (cost is not None and cost > target):
                break
            fits = b  # within the target, or not measured yet (it runs, and is measured)
        return min(self.max_tokens, max(fits, decode_rows + self.min_chunk))


class StepClock:
    """Each step's seconds into StepCosts: from its launch (or, queued behind the previous step
    under async scheduling, from that step's end) to its result, by the step's tokens."""

    def __init__(self, costs: StepCosts):
        self.costs = costs
        self._started: dict[int, float] = {}
        self._last_done = 0.0

    def launched(self, plan) -> None:
        if len(self._started) > 16:  # plans dropped unread (an engine reset): forget them
            self._started.clear()
        self._started[id(plan)] = time.perf_counter()

    def done(self, plan) -> None:
        now = time.perf_counter()
        start = self._started.pop(id(plan), None)
        if start is not None:
            self.costs.observe(plan.num_tokens, now - max(start, self._last_done))
        self._last_done = now


def step_budget(costs: StepCosts, max_tokens: int, target_itl_ms: Optional[float],
                num_processes: int = 1) -> Optional[StepBudget]:
    """The engine's StepBudget, or None where steps are not budgeted: target_itl_ms=0, or
    several processes (each would measure its own times and plan differently; they must plan
    alike)."""
    budget = StepBudget(costs, max_tokens, target_itl_ms)
    return budget if budget.enabled and num_processes == 1 else None
