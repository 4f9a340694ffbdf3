"""Steps budgeted by their measured costs (EngineConfig.target_itl_ms, multilora.engine.step_budget)
in the engine: a long prompt that arrives while streams decode is prefilled in chunks that keep
every step within the target by the cost model, and every request's greedy tokens are the
unbudgeted engine's and transformers + PEFT's. The cost model is a fake (a line in the step's
token bucket) that records the tokens of every step the engine measured. The tiny Llama with
test_engine's step shapes, so the compiles are shared."""

from __future__ import annotations

import pytest

from multilora.engine.engine import Engine
from multilora.engine.step_budget import StepCosts
from tests.test_engine import GREEDY, KW, assert_clean, check_vs_peft, prompts_of

ADAPTERS = {"a": "a_all_r8", "b": "b_attn_r4_rslora", "c": "c_mlp_r16"}
TOKEN_BUCKETS = (4, 8, 16, 32, 64)       # KW's: max_num_batched_tokens=64
TARGET_MS = 50                           # buckets up to 32 tokens fit (42 ms), 64 does not (74 ms)


class RecordedLine(StepCosts):
    """A step padded to bucket b costs 10 ms + 1 ms a token of b; each measured step's tokens kept."""

    def __init__(self):
        super().__init__(TOKEN_BUCKETS)
        self.steps: list[int] = []

    def observe(self, tokens, seconds):
        self.steps.append(tokens)
        super().observe(tokens, seconds)

    def estimate(self, tokens):
        return 0.010 + 0.001 * self.bucket(tokens)


@pytest.fixture(scope="module")
def setup(tiny_models, tiny_adapters):
    model_dir = tiny_models["llama"]
    dirs = {k: tiny_adapters[("llama", v)] for k, v in ADAPTERS.items()}
    mods = {k: str(v) for k, v in dirs.items()}
    engines = {}
    for target in (TARGET_MS, 0):
        costs = RecordedLine()
        engines[target] = (Engine(str(model_dir), mods, lora_backend="bgmv", target_itl_ms=target,
                                  step_costs=costs, **KW), costs)
    return engines, model_dir, dirs


def test_a_long_prompt_arriving_during_decode_is_split_within_the_target(setup, peft_greedy_cache):
    engines, model_dir, dirs = setup
    shorts, (long_prompt,) = prompts_of(41, [5, 7, 4]), prompts_of(42, [50])
    loras = ["a", None, "b", "c"]
    outs, after = {}, {}
    for target, (eng, costs) in engines.items():
        assert eng.buckets.tokens == TOKEN_BUCKETS
        assert (eng.step_budget is None) == (target == 0)
        gen_ = eng.generate([[5, 6, 7]] * 3, GREEDY, lora=loras[1:])  # every adapter read and resident
        assert all(len(o.token_ids) == GREEDY.max_tokens for o in gen_)
        ids = [eng.add_request(p, GREEDY, lora=l) for p, l in zip(shorts, loras)]
        while not all(eng.request(r).output_token_ids for r in ids):
            eng.step()                   # until all three stream
        first = len(costs.steps)
        ids.append(eng.add_request(long_prompt, GREEDY, lora=loras[3]))
        while eng.has_unfinished():
            eng.step()
        outs[target] = [eng.pop_output(r) for r in ids]
        after[target] = costs.steps[first:]
        assert_clean(eng)
    # Which of the three decode rows ride with the prompt's first step depends on which are still
    # in flight when it arrives (the scheduler runs a step ahead): 0 to 3 of them.
    # unbudgeted: the whole prompt in one step, with at most the three decode rows
    assert 50 <= after[0][0] <= 53, after[0]
    # budgeted: the prompt fills the first step to the budget (32 tokens: 29 to 32 of its own) and
    # its rest (18 to 21) follows in the next, no step past the target by the cost model
    assert after[TARGET_MS][0] == 32 and 50 - 32 <= after[TARGET_MS][1] <= 50 - 29 + 3, after[TARGET_MS]
    assert max(after[TARGET_MS]) <= 32, after[TARGET_MS]
    assert all(RecordedLine().estimate(n) <= TARGET_MS / 1000 for n in after[TARGET_MS]), after[TARGET_MS]
    assert [o.token_ids for o in outs[TARGET_MS]] == [o.token_ids for o in outs[0]]
    check_vs_peft(peft_greedy_cache, model_dir, dirs, shorts + [long_prompt], loras, outs[TARGET_MS])
