"""Tool calling and reasoning over HTTP, end to end: the official `openai` client against a real
uvicorn server in this process, over a tiny random Llama (whose chat template has no tool format:
the fallback) with two PEFT adapters, and a third adapter folder that ships its own chat template
with a tool format (rendered natively). A random model calls no tool on its own, so `required`
and named calls are forced by the grammar, and `auto` parsing is driven end to end by a grammar
that writes a call into free text (the parsers' own cases are in tests/test_tool_parsers.py).
Every call's arguments are validated against the function's schema with jsonschema.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import reference
from tests.test_server import API_KEY, Served, assert_error, serve_in_thread, wait_idle

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
jsonschema = pytest.importorskip("jsonschema")

EOS = 2   # <|im_end|> of the tiny tokenizer
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"enum": ["paris", "rome", "oslo"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
SEARCH = {"type": "function", "function": {
    "name": "search",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["q"],
                   "properties": {"q": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                  "exact": {"type": "boolean"}}}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "system", "content": "you are a model"}, {"role": "user", "content": "weather in rome?"}]
# a Qwen2.5-like template with a tool format of its own (an adapter folder ships it)
NATIVE_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call: <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}{% if m.role == 'system' and loop.first %}{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from multilora.engine.engine import Engine
    from multilora.server.app import build_app
    from multilora.server.async_engine import AsyncEngine

    root = tmp_path_factory.mktemp("server_tools")
    model_dir = reference.make_tokenized_tiny_model(root / "model")
    folders = {name: reference.make_adapter(model_dir, root / name, seed=21 + i,
                                            **reference.ADAPTER_SPECS[spec])
               for i, (name, spec) in enumerate({"a": "a_all_r8", "q": "b_attn_r4_rslora"}.items())}
    (folders["q"] / "tokenizer_config.json").write_text(json.dumps({"chat_template": NATIVE_TEMPLATE}))
    # a prompt with the fallback's tool list is ~800 tokens of the tiny tokenizer; few shapes to
    # compile (the server's background warm-up: requests compile what they need first)
    engine = Engine(str(model_dir), {n: str(p) for n, p in folders.items()}, max_loras_per_batch=2,
                    max_lora_rank=16, max_num_seqs=4, max_num_batched_tokens=128, page_size=32,
                    max_model_len=1280, warmup="background")
    aengine = AsyncEngine(engine, max_queue=64)
    app = build_app(aengine, api_key=API_KEY)
    server, thread, url = serve_in_thread(app)
    yield Served(url=url, engine=engine, app=app)
    server.should_exit = True
    thread.join(timeout=30)


def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, timeout=120, max_retries=0)


def http(served):
    return httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def check_calls(calls, names=None):
    assert calls, "no tool call"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and len(c.id) > 10
        assert c.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_required_and_named_calls_for_base_and_adapters_in_one_batch(served):
    """tool_choice "required" and a named function, for the base model and both adapters at
    once (sampled, several seeds): every answer is tool_calls whose arguments validate, content
    null, finish_reason "tool_calls"; parallel_tool_calls false gives exactly one call."""
    c = client(served)
    base = served.engine.model_name

    def ask(model, choice, seed, parallel):
        r = c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, seed=seed,
                                      temperature=1.0, max_tokens=160, parallel_tool_calls=parallel,
                                      logit_bias={str(EOS): 30})  # a random model: end after a call
        return model, choice, parallel, r.choices[0]

    named = {"type": "function", "function": {"name": "search"}}
    jobs = [(m, ch, s, p) for m in (base, "a", "q") for ch in ("required", named) for s, p in ((1, False), (2, True))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        for model, choice, parallel, ch in pool.map(lambda j: ask(*j), jobs):
            assert ch.finish_reason == "tool_calls", (model, choice, ch)
            assert ch.message.content is None and ch.message.role == "assistant"
            check_calls(ch.message.tool_calls, ["search"] if choice is named else None)
            if choice is named or not parallel:
                assert len(ch.message.tool_calls) == 1
    wait_idle(served)


def test_streamed_calls_assemble_into_valid_arguments(served):
    """A streamed forced call: each call's first delta carries index, id, type and name, then
    argument fragments; they assemble into the non-streamed call (greedy), finish_reason
    "tool_calls", the usage chunk last."""
    c = client(served)
    for model, choice in (("a", "required"), ("q", {"type": "function", "function": {"name": "get_weather"}})):
        kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0.0, max_tokens=160,
                  parallel_tool_calls=False)
        whole = c.chat.completions.create(**kw).choices[0]
        chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        assert chunks[-1].usage is not None and not chunks[-1].choices
        calls, reasons = {}, []
        for ch in chunks[:-1]:
            choice_ = ch.choices[0]
            reasons.append(choice_.finish_reason)
            assert not choice_.delta.content
            for d in choice_.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.id.startswith("call_") and d.type == "function" and d.function.name
                    calls[d.index] = {"name": d.function.name, "args": d.function.arguments or ""}
                else:
                    assert d.id is None and d.function.name is None
                    calls[d.index]["args"] += d.function.arguments
        assert [r for r in reasons if r] == ["tool_calls"] and reasons[-1] == "tool_calls"
        assert len(calls) == 1 and sum(len(ch.choices[0].delta.tool_calls or []) for ch in chunks[:-1]) > 1
        call = calls[0]
        jsonschema.validate(json.loads(call["args"]), SCHEMAS[call["name"]])
        assert call["name"] == whole.message.tool_calls[0].function.name
        assert json.loads(call["args"]) == json.loads(whole.message.tool_calls[0].function.arguments)


def test_follow_up_turn_with_the_tool_result_is_answered(served):
    """The call's turn and the tool's answer go back (as the openai client sends them) and are
    rendered: the fallback (a system preamble, the call in Hermes' syntax, the answer in
    <tool_response>) for the model's template, the adapter folder's own template for q."""
    c = client(served)
    first = c.chat.completions.create(model="a", messages=ASK, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, temperature=0.0, max_tokens=160)
    msg = first.choices[0].message
    turn = ASK + [msg.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny, 21 C"}]
    for model in (served.engine.model_name, "a", "q"):
        r = c.chat.completions.create(model=model, messages=turn, tools=TOOLS, tool_choice="none",
                                      temperature=0.0, max_tokens=8)
        ch = r.choices[0]
        assert ch.finish_reason in ("stop", "length") and ch.message.tool_calls is None
        assert isinstance(ch.message.content, str)
    with http(served) as h:
        def prompt(model):
            ids = h.post("/v1/tokenize", json=dict(model=model, messages=turn, tools=TOOLS)).json()["tokens"]
            return h.post("/v1/detokenize", json=dict(tokens=ids)).json()["prompt"]
        fallback, native = prompt("a"), prompt("q")
        # vLLM's chat_template_kwargs reach the template (Qwen3's enable_thinking here)
        ids = h.post("/v1/tokenize", json=dict(model="q", messages=ASK, chat_template_kwargs={"enable_thinking": False}))
        thinking_off = h.post("/v1/detokenize", json=dict(tokens=ids.json()["tokens"])).json()["prompt"]
        assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert c.chat.completions.create(model="q", messages=ASK, max_tokens=2, extra_body={
            "chat_template_kwargs": {"enable_thinking": False}}).choices[0].finish_reason in ("stop", "length")
    call = msg.tool_calls[0].function
    assert fallback.startswith("<|im_start|>system\nyou are a model\n\n# Tools\n")
    assert json.dumps(WEATHER) in fallback and "<tool_response>\nsunny, 21 C\n</tool_response>" in fallback
    assert (f'<tool_call>\n{{"name": "{call.name}", "arguments": {json.dumps(json.loads(call.arguments))}}}\n'
            "</tool_call>") in fallback
    assert native.startswith("<|im_start|>system\nyou are a model\n\n# Tools\n<tools>\n")
    assert "Call: <tool_call>" in native and "<|im_start|>user\n<tool_response>\nsunny, 21 C" in native


def test_auto_reads_calls_out_of_free_text(served):
    """tool_choice auto (the default with tools): the output is read with the Hermes parser; here
    a grammar makes the random model write text and a call, which come back as content and
    tool_calls, streamed or not. With no call in the output, it is all content."""
    c = client(served)
    grammar = ('start: "Let me check. " "<tool_call>\\n" %json ' + json.dumps({
        "x-guidance": {"whitespace_flexible": False}, "type": "object", "properties": {"name": {"const": "get_weather"},
                                         "arguments": WEATHER["function"]["parameters"]},
        "required": ["name", "arguments"], "additionalProperties": False}) + ' "\\n</tool_call>"')
    kw = dict(model="a", messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=160,
              extra_body={"guided_grammar": grammar})
    ch = c.chat.completions.create(**kw).choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me check."
    check_calls(ch.message.tool_calls, ["get_weather"])
    content, args = "", ""
    for chunk in c.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        content += d.content or ""
        args += "".join(t.function.arguments or "" for t in d.tool_calls or [])
    assert content == "Let me check." and json.loads(args) == json.loads(ch.message.tool_calls[0].function.arguments)
    # a call repeated word for word ends the choice there (generation stops), streamed or not; with
    # parallel_tool_calls false, the first call does
    call = '<tool_call>\n{{"name": "search", "arguments": {{"q": "{}"}}}}\n</tool_call>\n'.format
    kw.update(max_tokens=320, extra_body={"guided_grammar": "start: A B B B\nA: {}\nB: {}".format(
        json.dumps(call("x")), json.dumps(call("y")))})
    r = c.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    assert [json.loads(t.function.arguments)["q"] for t in r.choices[0].message.tool_calls] == ["x", "y"]
    full = c.chat.completions.create(**dict(kw, tools=None))  # the same tokens, not read: all four
    assert full.choices[0].message.content.count("<tool_call>") == 4
    assert r.usage.completion_tokens < full.usage.completion_tokens
    one = c.chat.completions.create(**dict(kw, parallel_tool_calls=False))
    assert len(one.choices[0].message.tool_calls) == 1 and one.usage.completion_tokens < r.usage.completion_tokens
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["tool_calls"]
    assert {t.index for ch in chunks for t in ch.choices[0].delta.tool_calls or []} == {0, 1}
    plain = c.chat.completions.create(model="q", messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=6)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")


def test_reasoning_parser_splits_think(served):
    """--reasoning-parser qwen3: <think>...</think> goes to reasoning_content (streamed:
    delta.reasoning_content), the rest to content; a forced call may come after reasoning."""
    srv = served.app.state.server
    srv.reasoning_parser = "qwen3"
    try:
        c = client(served)
        kw = dict(model=served.engine.model_name, messages=ASK, temperature=0.0, max_tokens=40,
                  extra_body={"guided_regex": r"<think>\n[a-z]{1,5}\n</think>\n\n[a-z]{1,4}"})
        msg = c.chat.completions.create(**kw).choices[0].message
        reasoning = msg.model_extra["reasoning_content"]
        assert reasoning.startswith("\n") and 1 <= len(reasoning.strip()) <= 5 and msg.content.isalpha()
        parts = {"reasoning_content": "", "content": ""}
        for chunk in c.chat.completions.create(stream=True, **kw):
            d = chunk.choices[0].delta
            parts["content"] += d.content or ""
            parts["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
        assert parts == {"reasoning_content": reasoning, "content": msg.content}
        # a forced call may follow the reasoning (the grammar lets a <think> block come first)
        finished = 0
        for seed in range(6):
            ch = c.chat.completions.create(model="a", messages=ASK, tools=TOOLS, tool_choice="required", seed=seed,
                                           parallel_tool_calls=False, temperature=1.0, max_tokens=100).choices[0]
            if ch.finish_reason == "tool_calls":
                finished += 1
                check_calls(ch.message.tool_calls)
                assert ch.message.content is None
            thought = ch.message.model_extra.get("reasoning_content")
            assert thought is None or "<tool_call>" not in thought
        assert finished
    finally:
        srv.reasoning_parser = None


def test_bad_tools_are_400_naming_what_is_allowed(served):
    base = served.engine.model_name
    ok = dict(model=base, messages=ASK, max_tokens=4)
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                 "properties": {"x": {"type": "nope"}}}}}
    cases = [
        (dict(ok, tool_choice="required"), "tool_choice", "needs tools"),
        (dict(ok, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
         "'get_weather', 'search'"),
        (dict(ok, tools=TOOLS, tool_choice="sometimes"), "tool_choice", "required"),
        (dict(ok, tools=[{"type": "function", "function": {"name": "a b"}}]), "tools", "letters, digits"),
        (dict(ok, tools=[WEATHER, WEATHER]), "tools", "twice"),
        (dict(ok, tools=[{"type": "retrieval"}]), "tools", "function"),
        (dict(ok, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
         "tools", "object"),
        (dict(ok, tools=[bad_schema], tool_choice="required"), "tools", "cannot be compiled"),
        (dict(ok, tools=TOOLS, tool_choice="required", guided_regex="a+"), "guided_regex", "cannot be combined"),
        (dict(ok, messages=ASK + [{"role": "assistant", "tool_calls": [{"id": "1"}]}]), "messages", "function"),
        (dict(ok, chat_template_kwargs={"tools": []}), "chat_template_kwargs", "set by the server"),
    ]
    with http(served) as h:
        for body, param, words in cases:
            err = assert_error(h.post("/v1/chat/completions", json=body), 400)
            assert err["param"] == param and words in err["message"], (body, err)
        srv = served.app.state.server
        srv.tool_call_parser = "none"
        try:
            err = assert_error(h.post("/v1/chat/completions", json=dict(ok, tools=TOOLS, tool_choice="auto")), 400)
            assert err["param"] == "tool_choice" and "--tool-call-parser" in err["message"]
            assert h.post("/v1/chat/completions", json=dict(ok, tools=TOOLS)).status_code == 200
        finally:
            srv.tool_call_parser = "auto"
        assert h.get("/health").status_code == 200
    wait_idle(served)


def test_fuzzed_tool_requests_get_no_server_error(served):
    """Hypothesis over the tool fields with a real model name (schemathesis' random names end
    in 404s before them): valid and invalid tools, choices, parallel flags and replayed turns,
    streamed or not. Never a 5xx; a 400 names its field; every forced call that finished
    validates against its function's schema; the server still serves afterwards."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings, strategies as st
    names = st.sampled_from(["get_weather", "search", "f", "a b", "", "x" * 70])
    params = st.sampled_from([None, {}, {"type": "string"}, {"type": "object", "properties": {"x": {"type": "nope"}}},
                              SCHEMAS["get_weather"], SCHEMAS["search"],
                              {"type": "object", "required": ["n"], "properties": {"n": {"enum": [1, 2]}}}])
    tool = st.builds(lambda n, p: {"type": "function", "function": {"name": n, **({} if p is None else {"parameters": p})}},
                     names, params)
    choice = st.one_of(st.none(), st.sampled_from(["none", "auto", "required", "bogus"]),
                       st.builds(lambda n: {"type": "function", "function": {"name": n}}, names))
    replay = st.sampled_from([[], [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "found"}],
        [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "not json"}}]}]])
    bodies = st.fixed_dictionaries({"tools": st.one_of(st.none(), st.lists(tool, max_size=3)), "tool_choice": choice,
                                    "parallel_tool_calls": st.sampled_from([None, True, False]),
                                    "stream": st.booleans(), "replay": replay})
    seen = []
    with http(served) as h:
        @settings(max_examples=15, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(bodies)
        def one(b):
            body = {k: v for k, v in b.items() if v is not None and k != "replay"}
            body.update(model="a", messages=ASK + b["replay"], max_tokens=48, temperature=1.0, seed=1,
                        logit_bias={str(EOS): 30})
            r = h.post("/v1/chat/completions", json=body)
            assert r.status_code < 500, r.text
            seen.append(r.status_code)
            if r.status_code == 400:
                assert r.json()["error"]["param"] in ("tools", "tool_choice", "messages", "parallel_tool_calls"), r.text
            elif r.status_code == 200 and not b["stream"]:
                choice_ = r.json()["choices"][0]
                schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in b["tools"] or []}
                for call in choice_["message"].get("tool_calls") or []:
                    jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
        one()
        assert {200, 400} <= set(seen), seen
        assert h.get("/health").status_code == 200
    wait_idle(served)
