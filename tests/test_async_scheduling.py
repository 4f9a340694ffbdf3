"""Async scheduling (EngineConfig.async_scheduling): the next step planned and dispatched while the
current one runs, its decode rows' tokens fed from the running step on the device. Against the
same engine stepping in sync (and, for greedy rows, transformers + PEFT): identical tokens,
logprobs and finish reasons in mixed runs (adapters beside base rows, greedy and seeded sampling,
stop ids, max_tokens, preemption), rows that need their tokens on the host (grammars, penalties,
prompt logprobs) stepping in sync beside plain ones, aborts and streams mid-flight, no page
leaked and nothing compiled after warm-up. The tiny Llama with a byte-level tokenizer (a grammar
needs token texts) and test_engine's step shapes, so the compiles are shared."""

from __future__ import annotations


import pytest

from multilora.config import EngineConfig
from multilora.engine.engine import Engine
from multilora.engine.request import PENDING_TOKEN, SamplingParams
from multilora.engine.structured import StructuredOutput
from tests import reference
from tests.test_engine import GREEDY, KW, MAX_MODEL_LEN, PAGE_SIZE, assert_clean, check_vs_peft, prompts_of

ADAPTERS = ("a_all_r8", "b_attn_r4_rslora", "c_mlp_r16")


@pytest.fixture(scope="module")
def setup(tiny_models, tiny_adapters, tmp_path_factory):
    model_dir, dirs = reference.tokenized_llama(tiny_models, tiny_adapters, tmp_path_factory.mktemp("async"), ADAPTERS)
    mods = {k: str(v) for k, v in dirs.items()}
    engines = {flag: Engine(str(model_dir), mods, lora_backend="bgmv", async_scheduling=flag, **KW)
               for flag in (False, True)}
    assert engines[True].async_scheduling and not engines[False].async_scheduling
    return engines, model_dir, dirs


def drive(eng: Engine, prompts, params, loras, max_steps=3000):
    """generate() with a step bound; no request ever shows a pending token."""
    rids = [eng.add_request(p, sp, lora=l) for p, sp, l in zip(prompts, params, loras)]
    for _ in range(max_steps):
        if not eng.has_unfinished():
            break
        for d in eng.step():
            assert PENDING_TOKEN not in d.token_ids
    else:
        pytest.fail(f"requests still unfinished after {max_steps} steps")
    return [eng.pop_output(r) for r in rids]


def summary(outs, tol=None):
    """Tokens, finish and stop reasons exactly; with tol, logprobs within tol (a step's batch
    shape may differ between runs, and with it the float sums)."""
    near = (lambda v: pytest.approx(v, abs=tol)) if tol else (lambda v: v)
    return [(o.token_ids, o.finish_reason, o.stop_reason,
             [(lp.token_id, near(lp.logprob), [t for t, _ in lp.top], near([v for _, v in lp.top]))
              for lp in o.logprobs] if o.logprobs is not None else None)
            for o in outs]


def test_a_mixed_run_is_the_sync_engines_token_for_token(setup, peft_greedy_cache):
    """24 requests over base + 3 adapters, greedy and seeded sampling, logprobs, a stop id,
    max_tokens from 1 to 24 (a request's last token is never computed again), first with plenty
    of pages, then with so few that requests are preempted while a step is in flight."""
    engines, model_dir, dirs = setup
    lengths = [1, 2, 3, 5, 7, 8, 9, 13, 16, 17, 24, 31, 33, 40, 20, 11, 4, 6, 15, 28, 19, 10, 12, 30]
    prompts = prompts_of(61, lengths)
    loras = [[None, "a", "b", "c"][i % 4] for i in range(len(prompts))]
    params = []
    for i in range(len(prompts)):
        kind = i % 4
        if kind == 0:
            params.append(GREEDY)
        elif kind == 1:
            params.append(SamplingParams(max_tokens=1 + i, temperature=0.9, seed=i, ignore_eos=True, logprobs=2))
        elif kind == 2:
            params.append(SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[7, 11, 13]))
        else:
            params.append(SamplingParams(max_tokens=1 + i % 5, temperature=0.7, top_p=0.9, seed=100 + i,
                                         ignore_eos=True))
    runs = {}
    for flag, eng in engines.items():
        before = dict(eng.stats)
        runs[flag, "plenty"] = drive(eng, prompts, params, loras)
        assert_clean(eng)
        keep = -(-MAX_MODEL_LEN // PAGE_SIZE) + 1  # room for one longest sequence and a page more
        held = eng.pages.allocate(eng.pages.num_free - keep)
        try:
            runs[flag, "few"] = drive(eng, prompts, params, loras)
        finally:
            eng.pages.free(held)
        assert_clean(eng)
        assert eng.stats["preemptions"] > before["preemptions"]
        overlapped = eng.stats["overlapped_steps"] - before["overlapped_steps"]
        steps = eng.stats["steps"] - before["steps"]
        assert (overlapped > steps // 2) if flag else overlapped == 0
    want = summary(runs[False, "plenty"])
    for key, outs in runs.items():
        assert summary(outs, 1e-4) == want, key
    greedy = [i for i, p in enumerate(params) if p is GREEDY]
    check_vs_peft(peft_greedy_cache, model_dir, dirs, [prompts[i] for i in greedy], [loras[i] for i in greedy],
                  [runs[True, "few"][i] for i in greedy])


def test_rows_that_need_their_tokens_on_the_host_step_in_sync_beside_the_others(setup):
    """A grammar row, a penalty row and a prompt-logprobs row among plain ones: the same outputs
    as the sync engine; the steps that carry them are not overlapped, the others are."""
    engines, _, _ = setup
    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    prompts = prompts_of(62, [9, 14, 6, 21, 3])
    params = [SamplingParams(max_tokens=30, temperature=0.0, structured=StructuredOutput.json_schema(schema)),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.5, seed=3, ignore_eos=True)]
    loras = ["a", None, "c", "b", "a"]
    outs = {}
    for flag, eng in engines.items():
        before = dict(eng.stats)
        outs[flag] = drive(eng, prompts, params, loras)
        assert_clean(eng)
        overlapped = eng.stats["overlapped_steps"] - before["overlapped_steps"]
        steps = eng.stats["steps"] - before["steps"]
        assert (0 < overlapped < steps - 1) if flag else overlapped == 0
    assert summary(outs[True], 1e-4) == summary(outs[False])
    assert [o.prompt_logprobs for o in outs[True]] == [o.prompt_logprobs for o in outs[False]]
    assert outs[True][0].finish_reason == "stop" and outs[True][0].text.startswith('{"n"')


def test_aborts_and_streams_while_a_step_is_in_flight(setup):
    """An abort between steps, while the engine holds a dispatched step with the request's
    pending token: the token is dropped, the request reports what it had, pages and adapter
    references come back; a stream's increments add up to its generate() output."""
    engines, _, _ = setup
    eng = engines[True]
    prompts = prompts_of(63, [12, 25, 7])
    rids = [eng.add_request(p, GREEDY, lora=l) for p, l in zip(prompts, ["a", None, "b"])]
    got = {r: [] for r in rids}
    for _ in range(4):
        for d in eng.step():
            got[d.request_id] += d.token_ids
    assert all(eng.request(r).awaiting for r in rids)  # a step holding their next tokens is in flight
    assert eng.abort_request(rids[0])
    out = eng.pop_output(rids[0])
    assert out.finish_reason == "abort" and PENDING_TOKEN not in out.token_ids
    assert out.token_ids == got[rids[0]]
    rest = drive(eng, [], [], [])  # the others run to their end
    assert rest == []
    for r in rids[1:]:
        o = eng.pop_output(r)
        assert o.finish_reason == "length" and len(o.token_ids) == GREEDY.max_tokens
    assert_clean(eng)
    full = engines[False].generate([prompts[1]], GREEDY, lora="c")[0].token_ids
    deltas = list(eng.stream(prompts[1], GREEDY, lora="c"))
    assert sum((d.token_ids for d in deltas), []) == full and deltas[-1].finished
    assert_clean(eng)


def test_the_setting_is_checked_and_defaults_to_accelerators_only():
    assert EngineConfig().async_scheduling is None
    with pytest.raises(ValueError, match="async_scheduling must be True, False or None"):
        EngineConfig(async_scheduling="yes")
    from multilora.cli.args import add_engine_args, engine_config_from_args
    import argparse
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--async-scheduling"])).async_scheduling is True
    assert engine_config_from_args(p.parse_args(["--no-async-scheduling"])).async_scheduling is False
    assert engine_config_from_args(p.parse_args([])).async_scheduling is None


def test_the_server_streams_an_async_engines_tokens(setup):
    """Through the HTTP server and the openai client, streamed and not, base and adapters at
    once: the async engine's completions are the sync engine's text."""
    import concurrent.futures

    import openai

    from multilora.server.app import build_app
    from multilora.server.async_engine import AsyncEngine
    from tests.test_server import API_KEY, serve_in_thread

    engines, _, _ = setup
    prompts = prompts_of(64, [10, 17, 5, 23])
    loras = [None, "a", "b", "c"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.text for o in engines[False].generate(prompts, params, lora=loras)]
    server, thread, url = serve_in_thread(build_app(AsyncEngine(engines[True], max_queue=16), api_key=API_KEY))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, timeout=120, max_retries=0)
        names = [lora or engines[True].model_name for lora in loras]

        def ask(i, stream):
            kw = dict(model=names[i], prompt=prompts[i], max_tokens=12, temperature=0.0,
                      extra_body={"ignore_eos": True})
            if not stream:
                return client.completions.create(**kw).choices[0].text
            return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda a: ask(*a), [(i, s) for s in (False, True) for i in range(len(prompts))]))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert got == want + want
    assert_clean(engines[True])
