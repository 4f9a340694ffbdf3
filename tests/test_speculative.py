"""Speculative decoding by n-gram lookup (EngineConfig.speculative_config), against the same engine
without it (itself checked against transformers + PEFT in test_engine, and here again for greedy
rows): greedy tokens identical in mixed batches (base rows beside three adapters), with the
lookup's own drafts and with drafts that are all right, partly wrong or run past a stop; seeded
rows repeat their tokens; sampling keeps the target distribution (a two-sample chi-square over
many seeds, the drafts accepted at the target's rate); grammars check the drafts; the prefix
cache, logprobs, async scheduling and the never-a-loss rule; the counters on /metrics, through
the server's engine thread; no page leaked, and every shape compiled one of the warm-up's; the
embedded model with the demo adapters at the CPU's bf16 defaults. The tiny Llama with a byte-level tokenizer and test_engine's step
shapes (KW), compiled on first use (warmup=False: a full warm-up would cost this file ~30 s more);
`clean` checks that each shape compiled is one that the warm-up compiles."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
from collections import Counter

import numpy as np
import pytest

from multilora import kernels
from multilora.config import EngineConfig, SpeculativeConfig
from multilora.engine.engine import Engine
from multilora.engine.request import SamplingParams
from multilora.engine.speculative import Speculator, propose_ngram
from multilora.engine.structured import StructuredOutput
from multilora.server.async_engine import AsyncEngine
from multilora.server.metrics import Metrics
from tests import reference
from tests.test_engine import GREEDY, KW, check_vs_peft, prompts_of
from tests.test_engine import assert_clean as _assert_clean

ADAPTERS = ("a_all_r8", "b_attn_r4_rslora", "c_mlp_r16")
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def setup(tiny_models, tiny_adapters, tmp_path_factory):
    model_dir, dirs = reference.tokenized_llama(tiny_models, tiny_adapters, tmp_path_factory.mktemp("spec"), ADAPTERS)
    mods = {k: str(v) for k, v in dirs.items()}
    off = Engine(str(model_dir), mods, lora_backend="bgmv", warmup=False, **KW)
    on = Engine(str(model_dir), mods, lora_backend="bgmv", speculative_config=SPEC, warmup=False, **KW)
    assert off.speculator is None and on.speculator is not None
    return off, on, model_dir, dirs


def assert_clean(eng: Engine) -> None:
    """test_engine's checks (pages back, no adapter reference left), and every shape compiled so
    far (steps, samplers, masks) one that the warm-up compiles: drafts add no shape."""
    _assert_clean(eng)
    planned = {(what, key) for what, key, _ in eng.runner.warmup_jobs()[0]}
    compiled = {(what, key) for what, table in eng.runner.compiler.tables.items() for key in table}
    assert compiled <= planned, sorted(compiled - planned)


def repetitive(seed: int, lengths) -> list[list[int]]:
    """Prompts that repeat a random phrase: the lookup finds drafts in them."""
    return [(p * 3)[:3 * len(p) - 1] for p in prompts_of(seed, lengths)]


def oracle(reference_outs, prompts, wrong_every: int = 0, past: int = 0):
    """A proposer that drafts the reference continuation of whichever prompt the tokens start
    with (every wrong_every-th draft token made wrong; `past` tokens drafted beyond its end)."""
    def propose(tokens):
        for p, o in zip(prompts, reference_outs):
            if tokens[:len(p)] == p and tokens[len(p):] == o.token_ids[:len(tokens) - len(p)]:
                nxt = (o.token_ids + [5] * past)[len(tokens) - len(p):][:4]
                return [(t + 1) % 256 if wrong_every and (len(tokens) + j) % wrong_every == 0 else t
                        for j, t in enumerate(nxt)]
        return []
    return propose


def counters(eng):
    return dict(eng.speculator.stats)


def lookup_again(eng):
    """The n-gram lookup back in place of a test's proposer."""
    k, lo, hi = (eng.speculator.cfg.num_speculative_tokens, eng.speculator.cfg.prompt_lookup_min,
                 eng.speculator.cfg.prompt_lookup_max)
    eng.speculator.propose = lambda tokens: propose_ngram(tokens, k, lo, hi)


def in_groups(eng, prompts, params, size=4, lora=None):
    """generate() a few requests at a time: KW's 8 logits rows leave room for drafts beside 4 rows."""
    lora = lora or [None] * len(prompts)
    return [o for i in range(0, len(prompts), size)
            for o in eng.generate(prompts[i:i + size], params[i:i + size], lora=lora[i:i + size])]


def test_the_config_is_checked_with_vllms_names():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (3, 4, 4)
    assert (SpeculativeConfig().prompt_lookup_min, SpeculativeConfig().prompt_lookup_max) == (5, 5)
    assert EngineConfig(speculative_config={"num_speculative_tokens": 2}).speculative_config.num_speculative_tokens == 2
    for bad, match in [({"method": "eagle"}, "method must be one of ngram, draft_model, got 'eagle'"),
                       ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
                       ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min .4. must be <="),
                       ({"lookahead": 2}, r"unknown field\(s\) lookahead; allowed: method, num_speculative_tokens"),
                       ("{not json", "speculative_config is not valid JSON"),
                       ([1], "must be a JSON object"),
                       ({"disable_by_batch_size": 0}, "disable_by_batch_size must be None or an integer >= 1")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(speculative_config=bad)
    from multilora.cli.args import add_engine_args, engine_config_from_args, engine_kwargs
    p = argparse.ArgumentParser()
    add_engine_args(p)
    got = engine_config_from_args(p.parse_args(["--speculative-config", json.dumps(SPEC)])).speculative_config
    assert got == SpeculativeConfig(**SPEC)
    assert engine_config_from_args(p.parse_args([])).speculative_config is None
    with pytest.raises(SystemExit, match="error: speculative_config: method must be one of ngram"):
        engine_kwargs(p.parse_args(["--speculative-config", '{"method": "medusa"}']))  # `multilora serve`'s launch


def test_the_lookup_takes_the_longest_latest_match():
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 8, 4, 2, 3]
    assert propose_ngram(seq, 3, 1, 3) == [7, 8, 4]      # "2 3" last seen before 7 (n=3 "4 2 3" never)
    assert propose_ngram(seq + [7], 2, 2, 3) == [8, 4]   # "2 3 7" matches
    assert propose_ngram([5, 6, 7], 4, 1, 3) == []       # no earlier occurrence
    assert propose_ngram([4, 4, 4, 4], 3, 1, 2) == [4]   # the latest match leaves one token after it
    assert propose_ngram([1], 3, 1, 3) == []


def test_greedy_tokens_are_identical_in_a_mixed_batch(setup, peft_greedy_cache):
    """Base rows and three adapters, the lookup's own drafts: the engine's tokens without
    speculation (and PEFT's); then oracle drafts, all right and every third one wrong, with a
    stop id and max_tokens landing inside accepted drafts: the same tokens, the drafts counted."""
    off, on, model_dir, dirs = setup
    prompts = repetitive(71, [5, 9, 4, 12, 7, 3])  # 6 rows: room for 2 drafts in KW's 8 logits rows
    loras = [[None, "a", "b", "c"][i % 4] for i in range(len(prompts))]
    params = [GREEDY if i % 3 else SamplingParams(max_tokens=14 - i, temperature=0.0, ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    want = off.generate(prompts, params, lora=loras)
    assert_clean(off)
    before = counters(on)
    got = on.generate(prompts, params, lora=loras)
    assert_clean(on)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert (g.logprobs is None) == (w.logprobs is None)
        for a, b in zip(g.logprobs or [], w.logprobs or []):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert counters(on)["num_drafts"] > before["num_drafts"]
    greedy = [i for i, p in enumerate(params) if p is GREEDY]
    check_vs_peft(peft_greedy_cache, model_dir, dirs, [prompts[i] for i in greedy], [loras[i] for i in greedy],
                  [got[i] for i in greedy])
    # a stop id three tokens in and a short max_tokens: both fall inside a run of accepted drafts
    stop = [SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[w.token_ids[3]]) if i % 2 else
            SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True) for i, w in enumerate(want)]
    want_stop = off.generate(prompts, stop, lora=loras)
    try:
        for wrong_every, past in ((0, 4), (3, 0)):
            on.speculator.propose = oracle(want, prompts, wrong_every, past)
            before = counters(on)
            assert [o.token_ids for o in on.generate(prompts, params, lora=loras)] == [o.token_ids for o in want]
            assert [(o.token_ids, o.finish_reason) for o in on.generate(prompts, stop, lora=loras)] == \
                [(o.token_ids, o.finish_reason) for o in want_stop]
            assert_clean(on)
            after = counters(on)
            drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
            accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
            assert 0 < accepted < drafted if wrong_every else accepted > drafted * 0.6, (accepted, drafted)
    finally:
        lookup_again(on)


def test_sampling_keeps_the_target_distribution(setup):
    """Sampled rows (temperature 0.8, top-k 8): seeded requests repeat their tokens exactly with
    and without speculation; over 320 seeds each, the second token's distribution with a draft
    (always the same token, accepted at the target's rate) matches the distribution without
    them (other seeds) by a two-sample chi-square test, and so do the accepted drafts' share
    and the target's probability of the draft."""
    off, on, _, _ = setup
    prompt = prompts_of(72, [6])[0]
    n = 320
    sp = lambda seed: SamplingParams(max_tokens=3, temperature=0.8, top_k=8, seed=seed, ignore_eos=True)
    base = off.generate([prompt] * n, [sp(s) for s in range(n)])
    second = Counter(o.token_ids[1] for o in base)
    draft = second.most_common(1)[0][0]
    on.speculator.propose = lambda tokens: [draft] if len(tokens) == len(prompt) + 1 else []
    try:
        before = counters(on)
        same = in_groups(on, [prompt] * 16, [sp(s) for s in range(16)])
        assert [o.token_ids for o in same] == [o.token_ids for o in base[:16]]  # seeds repeat
        spec = in_groups(on, [prompt] * n, [sp(s) for s in range(n, 2 * n)])
        assert_clean(on)
        after = counters(on)
    finally:
        lookup_again(on)
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert drafted == n + 16
    other = Counter(o.token_ids[1] for o in spec)
    # accepted at p(draft): the share of the draft among the non-speculative seeds' second tokens
    p_draft = second[draft] / n
    assert abs(accepted / drafted - p_draft) < 4 * np.sqrt(p_draft * (1 - p_draft) / n) + 0.02
    # two-sample chi-square over the categories seen at least 10 times (the rest pooled)
    cats = [t for t in set(second) | set(other) if second[t] + other[t] >= 10]
    rows = [(second[t], other[t]) for t in cats]
    rows.append((n - sum(a for a, _ in rows), n - sum(b for _, b in rows)))
    rows = [r for r in rows if sum(r)]
    chi2 = sum((a - b) ** 2 / (a + b) for a, b in rows)  # equal sample sizes
    df = len(rows) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * np.sqrt(2 / (9 * df))) ** 3  # p = 0.001 (Wilson-Hilferty)
    assert df >= 1 and chi2 < critical, (rows, chi2, critical)
    tv = 0.5 * sum(abs(a - b) for a, b in rows) / n
    assert tv < 0.12, tv


def test_grammars_check_the_drafts(setup):
    """A JSON-schema row beside free ones: drafts the grammar refuses are cut off before the step
    (an oracle drafting a wrong token after right ones), the masks of every drafted position
    follow the drafts before it: the same output as without speculation."""
    off, on, _, _ = setup
    schema = {"type": "object", "additionalProperties": False, "required": ["n", "s"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                             "s": {"type": "string", "maxLength": 6}}}
    prompts = repetitive(73, [6, 8, 5])
    params = [SamplingParams(max_tokens=30, temperature=0.0, structured=StructuredOutput.json_schema(schema)),
              GREEDY, SamplingParams(max_tokens=30, temperature=0.7, seed=5,
                                     structured=StructuredOutput.json_schema(schema))]
    loras = ["a", None, "b"]
    want = off.generate(prompts, params, lora=loras)
    assert want[0].text.startswith('{"n"')
    for propose in (None, oracle(want, prompts, wrong_every=2, past=3)):
        if propose is not None:
            on.speculator.propose = propose
        try:
            got = on.generate(prompts, params, lora=loras)
        finally:
            lookup_again(on)
        assert [(o.token_ids, o.finish_reason, o.text) for o in got] == \
            [(o.token_ids, o.finish_reason, o.text) for o in want]
        assert_clean(on)


def test_prefix_cache_async_scheduling_and_the_never_a_loss_rule(setup):
    """With async scheduling on, drafted rows step in sync (their tokens identical to the sync
    engine without speculation); prefix-cache hits stay exact; a step of as many tokens as
    max_step_tokens (or disable_by_batch_size rows) carries no drafts."""
    off, _, model_dir, dirs = setup
    mods = {k: str(v) for k, v in dirs.items()}
    eng = Engine(str(model_dir), mods, lora_backend="bgmv", async_scheduling=True, speculative_config=SPEC,
                 warmup=False, **KW)
    shared = repetitive(74, [9])[0]
    prompts = [shared + tail for tail in prompts_of(75, [3, 5, 2, 4])]
    loras = ["c", "c", None, None]
    want = off.generate(prompts, GREEDY, lora=loras)
    for _ in range(2):  # the second time from the prefix cache
        outs = eng.generate(prompts, GREEDY, lora=loras)
        assert [o.token_ids for o in outs] == [o.token_ids for o in want]
        assert_clean(eng)
    assert outs[0].num_cached_tokens > 0
    assert eng.speculator.stats["num_drafts"] > 0
    # 6 rows (prefilled in one step, so they decode together): the step has max_step_tokens
    # tokens already, so no drafts (though its logits rows have room); one row alone drafts
    eng.speculator = Speculator(SpeculativeConfig(**SPEC, max_step_tokens=6), eng.pages, 64, 8)
    eng.speculator.propose = lambda tokens: [3, 4]
    batch = repetitive(76, [3] * 6)
    assert [o.token_ids for o in eng.generate(batch, GREEDY)] == [o.token_ids for o in off.generate(batch, GREEDY)]
    assert eng.speculator.stats["num_drafts"] == 0
    eng.generate(batch[:1], GREEDY)
    assert eng.speculator.stats["num_drafts"] > 0
    eng.speculator = Speculator(SpeculativeConfig(**SPEC, disable_by_batch_size=2), eng.pages, 64, 8)
    eng.speculator.propose = lambda tokens: [3, 4]
    eng.generate(batch[:2], GREEDY)
    assert eng.speculator.stats["num_drafts"] == 0
    assert_clean(eng)


def test_the_counters_are_in_metrics_under_vllms_names(setup):
    """Through the server's engine thread (AsyncEngine): a repetitive prompt streamed to its end
    drafts; once the thread has stopped (its last snapshot taken after the last step), /metrics
    counts exactly the engine's drafts. Without speculation nothing spec_decode is exported."""
    off, on, _, _ = setup
    prompt = repetitive(77, [10])[0]

    async def stream_to_end(aengine):
        async with await aengine.submit(prompt, GREEDY) as stream:
            return [d async for d in stream][-1]

    for eng in (off, on):
        before = dict(eng.speculator.stats) if eng is on else None
        aengine = AsyncEngine(eng).start()
        try:
            final = asyncio.run(stream_to_end(aengine))
        finally:
            aengine.stop()
        assert final.finished and final.finish_reason == "length"
        text = aengine.metrics.render()
        drafts = f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="{eng.model_name}"}}'
        assert (drafts in text) == (eng is on)
        if eng is on:
            assert on.speculator.stats["num_drafts"] > before["num_drafts"]
            assert f"{drafts} {on.speculator.stats['num_drafts']}\n" in text
            accepted = f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="{eng.model_name}"}}'
            assert f"{accepted} {on.speculator.stats['num_accepted_tokens']}\n" in text
    m = Metrics("base")
    text = m.render()
    assert "vllm:spec_decode" not in text  # off: not exported
    m.set_snapshot({}, {}, {}, None, {"num_drafts": 3, "num_draft_tokens": 10, "num_accepted_tokens": 6,
                                      "accepted_per_pos": [3, 2, 1, 0]})
    text = m.render()
    for line in ('vllm:spec_decode_num_drafts_total{engine="0",model_name="base"} 3',
                 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="base"} 10',
                 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="base"} 6',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="base",position="1"} 2',
                 "# TYPE vllm:spec_decode_num_drafts counter"):
        assert line in text


def test_a_draft_model_proposes_and_the_target_keeps_its_tokens(setup, tiny_models, tmp_path):
    """method "draft_model": a second model's greedy tokens are the drafts. With the target itself
    as its draft, base rows' drafts are (nearly) all accepted; with another tiny model (the tied
    one: other widths and layers, the same 256 ids) fewer; either way the greedy tokens, logprobs
    and stops are the engine's without speculation, beside three adapters (the draft runs without
    them). A draft of another vocabulary, or a config without its folder, is refused by name."""
    off, _, model_dir, dirs = setup
    mods = {k: str(v) for k, v in dirs.items()}
    prompts = prompts_of(78, [5, 9, 4, 12, 7, 3])
    loras = [[None, "a", "b", "c"][i % 4] for i in range(len(prompts))]
    params = [GREEDY if i % 3 else SamplingParams(max_tokens=14 - i, temperature=0.0, ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    want = off.generate(prompts, params, lora=loras)
    stop = [SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[w.token_ids[3]]) for w in want]
    want_stop = off.generate(prompts, stop, lora=loras)
    for draft, least in ((model_dir, 0.9), (tiny_models["tied"], 0.0)):
        eng = Engine(str(model_dir), mods, lora_backend="bgmv", warmup=False, **KW, speculative_config={
            "method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "max_step_tokens": 64})
        if least == 0.0:  # the draft's own warm-up: nothing of it compiles later
            eng.speculator.drafter.warmup()
        base = [i for i, lo in enumerate(loras) if lo is None]
        got = in_groups(eng, [prompts[i] for i in base], [params[i] for i in base])
        stats = counters(eng)
        assert stats["num_draft_tokens"] > 0
        assert stats["num_accepted_tokens"] >= least * stats["num_draft_tokens"], stats
        assert [o.token_ids for o in got] == [want[i].token_ids for i in base]
        got = in_groups(eng, prompts, params, size=2, lora=loras)  # two rows a step: room for drafts
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for g, w in zip(got, want):
            for a, b in zip(g.logprobs or [], w.logprobs or []):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [(o.token_ids, o.finish_reason) for o in in_groups(eng, prompts, stop, size=2, lora=loras)] == \
            [(o.token_ids, o.finish_reason) for o in want_stop]
        assert counters(eng)["num_draft_tokens"] > stats["num_draft_tokens"]  # adapter rows drafted too
        # four rows of 40 prompt tokens: the draft's first catch-up (160 tokens) passes its steps'
        # 64, so rows catch up over several steps, drafting once they have
        longer = prompts_of(79, [40, 41, 39, 40])
        assert [o.token_ids for o in eng.generate(longer, GREEDY)] == \
            [o.token_ids for o in off.generate(longer, GREEDY)]
        assert_clean(eng)
        if least == 0.0:
            assert eng.speculator.drafter.runner.compiles_after_warmup == 0
    other = tmp_path / "other_vocab"
    shutil.copytree(tiny_models["tied"], other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 300}))
    with pytest.raises(ValueError, match="the draft model .* has a vocabulary of 300 tokens, the target 256"):
        Engine(str(model_dir), warmup=False, **KW, speculative_config={"method": "draft_model", "model": str(other)})
    for bad in ({"method": "draft_model"}, {"method": "ngram", "model": str(model_dir)}):
        with pytest.raises(ValueError, match="method 'draft_model' takes the draft's folder as `model`"):
            EngineConfig(speculative_config=bad)

COPY_TEXT = ("The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night "
             "its keeper climbed the one hundred and twelve steps to light the lamp, and every morning he "
             "wrote the weather in a small blue notebook.")


def test_greedy_tokens_are_identical_on_the_embedded_model_at_the_cpu_defaults():
    """The embedded SmolLM2 with the demo adapters at the engine's defaults (on a CPU with the bf16
    GEMM: bfloat16 projections and adapter pool, multilora's kernels), base rows, `shout` and
    `signoff` in one mixed batch of copy-heavy and open prompts, drafts allowed in every step:
    greedy tokens identical with and without speculation, and every token's logprob the same up
    to the sampler's float sums (the logits are the same bits: test_batch_invariance). Before
    decode rows and verify chunks took one arithmetic, bf16 rounding turned their last-bit
    differences into logprobs off by ~1e-2 and, on near ties, other tokens."""
    from multilora import default_model as dm
    from multilora.demo_adapters import demo_lora_modules
    from multilora.engine.runner import Buckets
    try:
        model_dir = dm.default_model_dir()
    except Exception as e:  # offline machine without the converted model
        pytest.skip(f"the default model (SmolLM2-135M-Instruct) could not be fetched: {e}")
    # decode steps of 1-3 rows (T=4), of more rows or with drafts (T=16), prefills (T=256)
    buckets = Buckets(tokens=(4, 16, 256), pages=(64,), max_num_seqs=16, max_pages_seq=16, page_size=16)
    # what projection_dtype "auto" picks without this session's float32 (conftest): bfloat16 where
    # multilora's bf16 GEMM runs (then the adapter pool is bfloat16 too)
    auto = "bfloat16" if kernels.bf16_gemm_isa() else "float32"
    eng = Engine(str(model_dir), demo_lora_modules(), max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256,
                 page_size=16, warmup=False, buckets=buckets, projection_dtype=auto,
                 speculative_config={**SPEC, "prompt_lookup_min": 2, "max_step_tokens": 16})
    questions = [f"Repeat this text word for word:\n\n{COPY_TEXT}", "Why do cats purr?",
                 f"Rewrite this text with 'keeper' replaced by 'guardian':\n\n{COPY_TEXT}"]
    runs = [(q, lora) for q in questions for lora in (None, "shout", "signoff")]
    prompts = [eng.tokenizer.encode_chat([{"role": "user", "content": q}]) for q, _ in runs]
    loras = [lora for _, lora in runs]
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=1)
    speculator, outs = eng.speculator, {}
    for mode in ("off", "on"):
        eng.speculator = speculator if mode == "on" else None
        outs[mode] = eng.generate(prompts, params, lora=loras)
    eng.speculator = speculator
    assert eng.projection_mode == ("bfloat16-packed" if auto == "bfloat16" else "float32")
    assert speculator.stats["num_accepted_tokens"] > 40, speculator.stats  # drafts were verified in mixed steps
    for i, (off, on) in enumerate(zip(outs["off"], outs["on"])):
        assert on.token_ids == off.token_ids, (i, loras[i])
        np.testing.assert_allclose([lp.logprob for lp in on.logprobs], [lp.logprob for lp in off.logprobs],
                                   atol=2e-5, rtol=0, err_msg=f"request {i} ({loras[i]})")
    assert_clean(eng)
