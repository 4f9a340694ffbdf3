"""The HTTP server end to end: the official `openai` client (and raw httpx) against a real uvicorn
server on 127.0.0.1, over a tiny random Llama with a 256-token byte-level BPE tokenizer built here.

One engine serves the whole module (its compile is the expensive part). The offline references
are computed through that same Engine object, one request at a time, before the server starts.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests import reference

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

API_KEY = "sk-multilora-test"
MAX_MODEL_LEN = 128
ENGINE_KW = dict(max_loras_per_batch=4, max_lora_rank=16, max_num_seqs=8, max_num_batched_tokens=64,
                 page_size=8, max_model_len=MAX_MODEL_LEN)
MAX_BODY = 64 * 1024
PROMPTS = ["hello world", "once upon a time there was", "tell me a story about cats",
           "the quick brown fox jumps over", "many small requests share one batch",
           "how are you today?", "a little model that served", "streaming tokens arrive"]
ADAPTERS = {"a": "a_all_r8", "b": "b_attn_r4_rslora", "c": "c_mlp_r16"}   # c: loaded at run time
CHAT = [{"role": "system", "content": "you are a model"}, {"role": "user", "content": "tell me a story"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """What the module fixture hands the tests."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def client(self, **kw) -> "openai.OpenAI":
        kw.setdefault("api_key", API_KEY)
        return openai.OpenAI(base_url=self.url + "/v1", timeout=120, max_retries=0, **kw)

    def http(self, key: str | None = API_KEY, **kw) -> "httpx.Client":
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        kw.setdefault("timeout", 120)
        return httpx.Client(base_url=self.url, headers=headers, **kw)

    def metrics_text(self) -> str:
        with self.http() as c:
            r = c.get("/metrics")
        assert r.status_code == 200
        return r.text

    def metrics(self) -> dict:
        return parse_metrics(self.metrics_text())


def ref_key(prompt, lora, max_tokens):
    return (tuple(prompt) if isinstance(prompt, list) else prompt, lora, max_tokens)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from multilora.engine.engine import Engine
    from multilora.engine.request import SamplingParams
    from multilora.server.async_engine import AsyncEngine
    from multilora.server.app import build_app

    root = tmp_path_factory.mktemp("server")
    model_dir = root / "model"
    model_dir.mkdir()
    vocab = reference.make_tiny_tokenizer(model_dir)
    assert vocab == reference.TINY_CONFIGS["llama"]["vocab_size"]
    reference.make_tiny_model(model_dir, "llama")
    lora_root = root / "adapters"
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        reference.make_adapter(model_dir, lora_root / spec, seed=11 + i, **reference.ADAPTER_SPECS[spec])
    outside = reference.make_adapter(model_dir, root / "outside" / "evil", seed=5,
                                     **reference.ADAPTER_SPECS["a_all_r8"])
    (lora_root / "link_out").symlink_to(outside, target_is_directory=True)
    (lora_root / "broken").mkdir()
    (lora_root / "broken" / "adapter_config.json").write_text("{not json")

    engine = Engine(str(model_dir), {n: str(lora_root / ADAPTERS[n]) for n in ("a", "b")}, **ENGINE_KW)
    # Offline references, each request alone, through the very engine the server will drive.
    engine.load_lora_adapter("c", str(lora_root / ADAPTERS["c"]))
    refs = {}
    chat_ids = engine.tokenizer.encode_chat(CHAT)
    jobs = [(p, lora, 8 + 2 * (i % 7)) for i, p in enumerate(PROMPTS) for lora in (None, "a", "b", "c")]
    jobs += [(chat_ids, lora, 12) for lora in (None, "a")]
    for prompt, lora, max_tokens in jobs:
        out = engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                              lora=lora)[0]
        refs[ref_key(prompt, lora, max_tokens)] = out
    engine.unload_lora_adapter("c")
    assert engine.pages.num_used == 0 and not engine.has_unfinished()

    aengine = AsyncEngine(engine, max_queue=64)
    app = build_app(aengine, api_key=API_KEY, lora_root=str(lora_root), max_body_bytes=MAX_BODY)
    server, thread, url = serve_in_thread(app)
    yield Served(url=url, engine=engine, aengine=aengine, server=server,
                 refs=refs, chat_ids=chat_ids, model_dir=model_dir, lora_root=lora_root, outside=outside,
                 jobs=jobs)
    server.should_exit = True
    thread.join(timeout=30)
    assert not aengine.is_alive


def serve_in_thread(app) -> tuple["uvicorn.Server", threading.Thread, str]:
    """A uvicorn server for app on a free local port, in a daemon thread, once it listens."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning",
                                           lifespan="on", timeout_graceful_shutdown=10))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"


# ---- helpers ---------------------------------------------------------------------------------------
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? '
                     r'(-?[0-9.eE+-]+|[+-]Inf|NaN)$')


def parse_metrics(text: str) -> dict:
    """A strict reader of the Prometheus text format: {(name, ((label, value), ...)): float}."""
    out, types = {}, {}
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            types[name] = kind
            continue
        if line.startswith("#"):
            assert line.startswith("# HELP "), line
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        labels = tuple(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        family = re.sub(r"_(bucket|sum|count)$", "", m.group(1))
        assert m.group(1) in types or family in types, f"sample without a TYPE line: {line!r}"
        out[(m.group(1), labels)] = float(m.group(3))
    out["__types__"] = types
    return out


def metric(ms: dict, name: str, **labels) -> float:
    want = tuple(sorted(labels.items()))
    return sum(v for (n, ls), v in ((k, v) for k, v in ms.items() if k != "__types__")
               if n == name and tuple(sorted(ls)) == want)


def wait_idle(served, timeout=20.0) -> dict:
    deadline = time.time() + timeout
    while True:
        ms = served.metrics()
        if (metric(ms, "multilora_num_requests_running") == 0 and metric(ms, "multilora_kv_pages_used") == 0
                and metric(ms, "multilora_num_requests_waiting") == 0):
            return ms
        assert time.time() < deadline, "the engine did not go idle"
        time.sleep(0.05)


def assert_error(r, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


def greedy(**kw) -> dict:
    return dict(temperature=0.0, extra_body={"ignore_eos": True}, **kw)


def model_name(served, lora):
    return lora if lora is not None else served.engine.model_name


# ---- tests -------------------------------------------------------------------------------------------
def test_models_lists_base_and_adapters(served):
    models = served.client().models.list()
    by_id = {m.id: m for m in models.data}
    base = served.engine.model_name
    assert set(by_id) == {base, "a", "b"}
    assert getattr(by_id[base], "parent", None) is None
    assert by_id["a"].parent == base and by_id["b"].parent == base
    assert by_id["a"].root.endswith(ADAPTERS["a"])


def test_completions_match_offline_engine_and_adapter_changes_text(served):
    client = served.client()
    prompt, max_tokens = PROMPTS[1], 10
    texts = {}
    for lora in (None, "a", "b"):
        ref = served.refs[ref_key(prompt, lora, max_tokens)]
        r = client.completions.create(model=model_name(served, lora), prompt=prompt, **greedy(max_tokens=max_tokens))
        assert r.object == "text_completion" and r.model == model_name(served, lora)
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == max_tokens == len(ref.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + max_tokens
        texts[lora] = r.choices[0].text
    assert texts[None] != texts["a"] and texts[None] != texts["b"] and texts["a"] != texts["b"]
    # The base model answers to its path too; token-id prompts work.
    ref = served.refs[ref_key(prompt, None, max_tokens)]
    r = client.completions.create(model=str(served.model_dir), prompt=ref.prompt_token_ids,
                                  **greedy(max_tokens=max_tokens))
    assert r.choices[0].text == ref.text


def test_chat_matches_offline_engine(served):
    client = served.client()
    for lora in (None, "a"):
        ref = served.refs[ref_key(served.chat_ids, lora, 12)]
        r = client.chat.completions.create(model=model_name(served, lora), messages=CHAT, **greedy(max_tokens=12))
        assert r.object == "chat.completion"
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == ref.text
        assert r.usage.prompt_tokens == len(served.chat_ids) and r.usage.completion_tokens == 12
    # Without max_tokens a chat may use the whole context.
    r = client.chat.completions.create(model="a", messages=CHAT, temperature=0.0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == MAX_MODEL_LEN


def test_streaming_equals_non_streaming(served):
    client = served.client()
    for lora in (None, "b"):
        kw = greedy(max_tokens=14)
        full = client.completions.create(model=model_name(served, lora), prompt=PROMPTS[3], **kw)
        chunks = list(client.completions.create(model=model_name(served, lora), prompt=PROMPTS[3], stream=True,
                                                stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == full.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 14 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens

        full = client.chat.completions.create(model=model_name(served, lora), messages=CHAT, **kw)
        chunks = list(client.chat.completions.create(model=model_name(served, lora), messages=CHAT, stream=True,
                                                     stream_options={"include_usage": True}, **kw))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == full.choices[0].message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 14
    # The raw SSE: data lines, then the terminator.
    with served.http() as c, c.stream("POST", "/v1/completions", json=dict(
            model="a", prompt=PROMPTS[0], max_tokens=5, temperature=0, stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    with served.http() as c, c.stream("POST", "/v1/chat/completions", json=dict(
            model="a", messages=CHAT, max_tokens=3, temperature=0, stream=True)) as r:
        deltas = [json.loads(ln[6:])["choices"][0]["delta"] for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:]), deltas


def test_logprobs(served):
    client = served.client()
    r = client.completions.create(model="a", prompt=PROMPTS[0], logprobs=3, **greedy(max_tokens=6))
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert math.isclose(max(top.values()), chosen, rel_tol=1e-5, abs_tol=1e-5)  # greedy: the top one
    r = client.chat.completions.create(model="b", messages=CHAT, logprobs=True, top_logprobs=2, **greedy(max_tokens=5))
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == r.choices[0].message.content


def test_prompt_lists_and_stop_strings(served):
    client = served.client()
    refs = [served.refs[ref_key(PROMPTS[i], "a", 8 + 2 * i)] for i in (0, 1)]
    r = client.completions.create(model="a", prompt=[PROMPTS[0], PROMPTS[1]], **greedy(max_tokens=8))
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == refs[0].text and refs[1].text.startswith(r.choices[1].text)
    assert r.usage.completion_tokens == 16
    chunks = list(client.completions.create(model="a", prompt=[PROMPTS[0], PROMPTS[1]], stream=True,
                                            **greedy(max_tokens=8)))
    for i in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) == r.choices[i].text
    # A stop string cuts the text where it first appears, streaming or not.
    ref = served.refs[ref_key(PROMPTS[3], None, 8 + 2 * 3)]
    stop = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 2]
    want = ref.text[:ref.text.find(stop)]
    kw = dict(model=served.engine.model_name, prompt=PROMPTS[3], stop=[stop], **greedy(max_tokens=14))
    r = client.completions.create(**kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices) == want


def test_a_failing_engine_step_fails_only_its_requests(served):
    def break_next_step(engine):
        def failing_step():
            del engine.step          # only this one step fails
            raise RuntimeError("injected failure")
        engine.step = failing_step

    asyncio.run(served.aengine.call(break_next_step))
    with served.http() as c:
        err = assert_error(c.post("/v1/completions", json=dict(model="a", prompt=PROMPTS[0], max_tokens=4)), 500)
    assert "injected failure" in err["message"]
    assert served.engine.pages.num_used == 0 and not served.engine.has_unfinished()
    r = served.client().completions.create(model="a", prompt=PROMPTS[0], **greedy(max_tokens=8))
    assert r.choices[0].text == served.refs[ref_key(PROMPTS[0], "a", 8)].text
    with served.http(key=None) as c:
        assert c.get("/health").status_code == 200


def test_health_reports_the_warmup(served):
    """GET /health: 200 while the engine runs, and how many of the step shapes are compiled (a
    `multilora serve` compiles most of them in the background once it answers requests)."""
    with served.http(key=None) as c:
        r = c.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok"
    w = body["warmup"]
    assert w["done"] is True and w["compiled"] == w["total"] > 0 and w["seconds"] >= 0
    # what runs, by name: the engine's dtype as asked and each part's (multilora.model.precision)
    assert body["precision"] == served.engine.precision.as_dict()
    assert set(body["precision"]) == {"dtype", "activations", "projections", "kv_cache", "adapter_pool"}


def test_unknown_model_is_404(served):
    with pytest.raises(openai.NotFoundError):
        served.client().completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    with served.http() as c:
        err = assert_error(c.post("/v1/chat/completions", json=dict(model="nope", messages=CHAT)), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found"


def test_served_model_names_replace_the_folder_name(served):
    """--served-model-name (vLLM's): the first name is listed and any is taken as the base model, the
    folder's name no longer is; a name an adapter has, none, or one twice is refused before serving.
    A second app over the same running engine (TestClient without its lifespan: no second start)."""
    from starlette.testclient import TestClient

    from multilora.server.app import build_app
    from multilora.server.service import check_served_names
    metrics = served.aengine.metrics
    label = metrics.base_name
    try:
        c = TestClient(build_app(served.aengine, served_model_names=["my-base", "org/my-base"]))
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert ids[0] == "my-base" and set(ids) == {"my-base", "a", "b"}, ids
        body = dict(prompt=PROMPTS[1], max_tokens=10, temperature=0.0, ignore_eos=True)
        out = {name: c.post("/v1/completions", json=dict(body, model=name)).json() for name in ("my-base", "org/my-base")}
        assert out["my-base"]["model"] == "my-base" and out["org/my-base"]["model"] == "org/my-base"
        want = served.refs[ref_key(PROMPTS[1], None, 10)].text
        assert out["my-base"]["choices"][0]["text"] == out["org/my-base"]["choices"][0]["text"] == want
        err = assert_error(c.post("/v1/completions", json=dict(body, model=served.engine.model_name)), 404)
        assert "my-base" in err["message"], err
    finally:
        metrics.base_name = label
    # --chat-template: the base model's requests render with it (an adapter with no template of its own too)
    try:
        c = TestClient(build_app(served.aengine, chat_template="{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"))
        for model in (served.engine.model_name, "a"):
            got = c.post("/v1/tokenize", json=dict(model=model, messages=[{"role": "user", "content": "hi"}])).json()
            assert got["tokens"] == served.engine.tokenizer.encode("<<hi>>", add_special_tokens=False), (model, got)
    finally:
        metrics.base_name = label
    for names, words in ((["a"], "names both the base model and a LoRA adapter"), ([], "one or more"),
                         (["x", ""], "one or more"), (["x", "x"], "repeats")):
        with pytest.raises(ValueError, match=words):
            check_served_names(names, ["a", "b"])


def test_generation_config_gives_the_defaults_of_unset_sampling_fields(served, tmp_path):
    """--generation-config (vLLM's): a folder whose generation_config.json sets temperature 0 makes
    a request without a temperature greedy (the offline reference's tokens); its own temperature
    still wins; "vllm" keeps OpenAI's default (1.0: sampled, not the greedy tokens)."""
    from starlette.testclient import TestClient

    from multilora.server.app import build_app
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 0}))
    label = served.aengine.metrics.base_name
    try:
        greedy_default = TestClient(build_app(served.aengine, generation_config=str(tmp_path)))
        openai_default = TestClient(build_app(served.aengine, generation_config="vllm"))
        assert greedy_default.app.state.server.sampling_defaults == {"temperature": 0.0, "top_k": -1}
        body = dict(model=served.engine.model_name, prompt=PROMPTS[1], max_tokens=10, ignore_eos=True, seed=7)
        want = served.refs[ref_key(PROMPTS[1], None, 10)].text
        assert greedy_default.post("/v1/completions", json=body).json()["choices"][0]["text"] == want
        sampled = [c.post("/v1/completions", json=dict(body, **kw)).json()["choices"][0]["text"]
                   for c, kw in ((openai_default, {}), (greedy_default, {"temperature": 1.0}))]
        assert sampled[0] == sampled[1] != want   # the same seed and temperature 1.0: the same draw
    finally:
        served.aengine.metrics.base_name = label


def test_load_and_unload_at_run_time(served):
    client = served.client()
    with served.http() as c:
        r = c.post("/v1/load_lora_adapter", json=dict(lora_name="c", lora_path=ADAPTERS["c"]))  # relative to root
        assert r.status_code == 200, r.text
        assert "c" in {m.id for m in client.models.list().data}
        for i in (0, 4):
            prompt, max_tokens = PROMPTS[i], 8 + 2 * (i % 7)
            ref = served.refs[ref_key(prompt, "c", max_tokens)]
            r2 = client.completions.create(model="c", prompt=prompt, **greedy(max_tokens=max_tokens))
            assert r2.choices[0].text == ref.text
        err = assert_error(c.post("/v1/load_lora_adapter", json=dict(
            lora_name="c", lora_path=str(served.lora_root / ADAPTERS["c"]))), 409)
        assert "already loaded" in err["message"]
        assert_error(c.post("/v1/load_lora_adapter", json=dict(
            lora_name=served.engine.model_name, lora_path=ADAPTERS["c"])), 409)
        r = c.post("/v1/unload_lora_adapter", json=dict(lora_name="c"))
        assert r.status_code == 200, r.text
        assert "c" not in {m.id for m in client.models.list().data}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="c", prompt="hi", max_tokens=2)
        assert_error(c.post("/v1/unload_lora_adapter", json=dict(lora_name="c")), 404)
        assert_error(c.post("/v1/load_lora_adapter", json=dict(lora_name="x")), 400)   # no lora_path


def test_adapter_paths_outside_root_are_refused(served):
    outside = served.outside
    cases = {
        "../outside/evil": 403,
        str(outside): 403,
        str(served.lora_root / ".." / "outside" / "evil"): 403,
        "link_out": 403,                 # a symlink inside the root that leads out of it
        "/etc/passwd": 403,
        "/": 403,
        "broken": 400,                   # inside, but not an adapter
        "does-not-exist": 400,
        "": 400,
    }
    with served.http() as c:
        for path, status in cases.items():
            err = assert_error(c.post("/v1/load_lora_adapter", json=dict(lora_name="evil", lora_path=path)), status)
            if status == 403:
                assert err["code"] == "lora_path_forbidden"
        assert "evil" not in {m.id for m in served.client().models.list().data}
    r = served.client().completions.create(model="a", prompt=PROMPTS[0], **greedy(max_tokens=8))
    assert r.choices[0].text == served.refs[ref_key(PROMPTS[0], "a", 8)].text


def test_adapters_resolve_on_first_use_under_the_root(served):
    """A `model` naming an adapter folder under --lora-root that is not registered is loaded on
    first use (concurrent first requests share one load) and then listed; names that lead out
    of the root, missing folders and bad adapters are refused with clear errors; nothing else
    changes."""
    from concurrent.futures import ThreadPoolExecutor
    client = served.client()
    name = ADAPTERS["c"]                 # the folder of adapter "c", never registered under this name
    prompt, max_tokens = PROMPTS[2], 8 + 2 * (2 % 7)
    ref = served.refs[ref_key(prompt, "c", max_tokens)]
    before = {m.id for m in client.models.list().data}
    assert name not in before
    try:
        with ThreadPoolExecutor(3) as ex:
            rs = list(ex.map(lambda _: client.completions.create(
                model=name, prompt=prompt, **greedy(max_tokens=max_tokens)), range(3)))
        assert [r.choices[0].text for r in rs] == [ref.text] * 3
        assert {m.id for m in client.models.list().data} == before | {name}
        with served.http() as c:
            for model, status, code in (("../outside/evil", 404, "model_not_found"),
                                        ("link_out", 404, "model_not_found"),    # a symlink out of the root
                                        ("does-not-exist", 404, "model_not_found"),
                                        ("broken", 400, "invalid_adapter")):
                err = assert_error(c.post("/v1/completions", json=dict(model=model, prompt="hi", max_tokens=2)),
                                   status)
                assert err["code"] == code and err["param"] == "model", (model, err)
                assert repr(model) in err["message"]
        assert {m.id for m in client.models.list().data} == before | {name}
        r = client.completions.create(model="a", prompt=PROMPTS[0], **greedy(max_tokens=8))
        assert r.choices[0].text == served.refs[ref_key(PROMPTS[0], "a", 8)].text
    finally:
        with served.http() as c:
            c.post("/v1/unload_lora_adapter", json=dict(lora_name=name))
    wait_idle(served)


def test_concurrent_streams_equal_requests_made_alone(served):
    jobs = [(p, lora, n) for p, lora, n in served.jobs if isinstance(p, str) and lora != "c"]
    jobs = (jobs * 2)[:32]
    assert len(jobs) == 32 and len({lora for _, lora, _ in jobs}) == 3

    async def one(client, prompt, lora, max_tokens):
        stream = await client.completions.create(
            model=model_name(served, lora), prompt=prompt, stream=True, stream_options={"include_usage": True},
            **greedy(max_tokens=max_tokens))
        text, usage, reason = [], None, None
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                usage = chunk.usage
        return "".join(text), usage.completion_tokens, reason

    async def main():
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=API_KEY, timeout=120, max_retries=0)
        try:
            return await asyncio.gather(*(one(client, *job) for job in jobs))
        finally:
            await client.close()

    before = served.metrics()
    steps0 = served.engine.stats["decode_steps"]
    results = asyncio.run(main())
    # They really shared batches: far fewer decode steps than tokens.
    assert served.engine.stats["decode_steps"] - steps0 < sum(n for _, _, n in jobs) / 3
    for (prompt, lora, max_tokens), (text, n, reason) in zip(jobs, results):
        ref = served.refs[ref_key(prompt, lora, max_tokens)]
        assert (text, n, reason) == (ref.text, len(ref.token_ids), "length"), (prompt, lora)
    ms = wait_idle(served)
    assert served.engine.pages.num_used == 0
    for lora in ("a", "b"):
        assert metric(ms, "multilora_requests_total", model=lora) - \
            metric(before, "multilora_requests_total", model=lora) == sum(1 for j in jobs if j[1] == lora)


def test_dropped_stream_frees_its_pages(served):
    before = served.metrics()
    aborted0 = metric(before, "multilora_requests_finished_total", model="a", finish_reason="abort")
    with served.http() as c:
        with c.stream("POST", "/v1/completions", json=dict(model="a", prompt=PROMPTS[2], max_tokens=110,
                                                           temperature=0, ignore_eos=True, stream=True)) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: ")
                if got >= 2:
                    break
        # leaving the block closes the connection mid-stream
    ms = wait_idle(served)
    assert metric(ms, "multilora_requests_finished_total", model="a", finish_reason="abort") == aborted0 + 1
    assert served.engine.pages.num_used == 0 and not served.engine.has_unfinished()

    # A non-streaming client that goes away is aborted too. Hold the engine thread so that the
    # request is certainly still queued when the client leaves.
    # The same for a stream left before its first chunk.
    for n, stream in enumerate((False, True)):
        gate = threading.Event()
        holder = threading.Thread(target=lambda: asyncio.run(served.aengine.call(lambda e: gate.wait(30))))
        holder.start()
        try:
            with served.http(timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
                c.post("/v1/completions", json=dict(model="a", prompt=PROMPTS[2], max_tokens=110, temperature=0,
                                                    ignore_eos=True, stream=stream))
        finally:
            gate.set()
            holder.join()
        ms = wait_idle(served)
        assert metric(ms, "multilora_requests_finished_total", model="a", finish_reason="abort") == aborted0 + 2 + n
        assert served.engine.pages.num_used == 0


def test_api_key_is_required(served):
    with served.http(key=None) as c:
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions"), ("POST", "/v1/load_lora_adapter"),
                             ("POST", "/v1/unload_lora_adapter")):
            err = assert_error(c.request(method, path, json={}), 401)
            assert err["code"] == "invalid_api_key"
        assert c.get("/health").status_code == 200
    with served.http(key="wrong") as c:
        assert_error(c.get("/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        served.client(api_key="wrong").completions.create(model="a", prompt="hi", max_tokens=2)


def test_bad_requests_are_400(served):
    base = served.engine.model_name
    ok = dict(model=base, prompt="hello", max_tokens=4)
    long_prompt = list(range(3, 3 + MAX_MODEL_LEN))
    bad = [
        (dict(ok, max_tokens=0), "max_tokens"),
        (dict(ok, max_tokens=-5), "max_tokens"),
        (dict(ok, max_tokens=MAX_MODEL_LEN), "max_tokens"),          # prompt + max_tokens beyond the context
        (dict(ok, prompt=long_prompt, max_tokens=1), "prompt"),
        (dict(ok, prompt=""), "prompt"),
        (dict(ok, prompt=[]), "prompt"),
        (dict(ok, prompt=[1, 9999]), "prompt"),                      # token id outside the vocabulary
        (dict(ok, prompt=5), "prompt"),
        (dict(ok, temperature="hot"), "temperature"),
        (dict(ok, temperature=-1.0), "temperature"),
        (dict(ok, max_tokens="4"), "max_tokens"),
        (dict(ok, stream="yes"), "stream"),
        (dict(ok, n=0), "n"),
        (dict(ok, top_p=0.0), "top_p"),
        (dict(ok, logprobs=50), "logprobs"),
        ({"prompt": "hello"}, "model"),
    ]
    with served.http() as c:
        for body, param in bad:
            err = assert_error(c.post("/v1/completions", json=body), 400)
            assert err["param"] == param, (body, err)
        for body in (dict(model=base, messages=[]), dict(model=base, messages="hi"),
                     dict(model=base, messages=CHAT, max_tokens=0),
                     dict(model=base, messages=CHAT, top_logprobs=2),
                     dict(model=base, messages=[{"role": "user", "content": [{"type": "image_url"}]}])):
            assert_error(c.post("/v1/chat/completions", json=body), 400)
        for raw in (b"{not json", b"[1, 2]", b"", b'"text"'):
            assert_error(c.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"}), 400)
    with pytest.raises(openai.BadRequestError):
        served.client().completions.create(model=base, prompt="hello", max_tokens=0)
    # ...and the server is unaffected.
    r = served.client().completions.create(model="b", prompt=PROMPTS[5], **greedy(max_tokens=8 + 2 * 5))
    assert r.choices[0].text == served.refs[ref_key(PROMPTS[5], "b", 18)].text


def test_oversized_body_is_413(served):
    big = json.dumps(dict(model="a", prompt="x" * (MAX_BODY + 10), max_tokens=2)).encode()
    with served.http() as c:
        assert_error(c.post("/v1/completions", content=big, headers={"Content-Type": "application/json"}), 413)

    def chunks():  # no Content-Length: the streamed size is what counts
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    with served.http() as c:
        assert_error(c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413)
    r = served.client().completions.create(model="a", prompt=PROMPTS[0], **greedy(max_tokens=8))
    assert r.choices[0].text == served.refs[ref_key(PROMPTS[0], "a", 8)].text


def test_full_queue_is_503(served):
    served.aengine.max_queue = 0
    try:
        with pytest.raises(openai.InternalServerError) as e:
            served.client().completions.create(model="a", prompt="hi", max_tokens=2)
        assert e.value.status_code == 503
    finally:
        served.aengine.max_queue = 64
    assert metric(served.metrics(), "multilora_requests_rejected_total", reason="queue_full") >= 1
    served.client().completions.create(model="a", prompt="hi", max_tokens=2)


def test_metrics_parse(served):
    served.client().completions.create(model="b", prompt=PROMPTS[0], **greedy(max_tokens=3))
    ms = served.metrics()
    types = ms["__types__"]
    assert types["multilora_requests_total"] == "counter"
    assert types["multilora_kv_pages_used"] == "gauge"
    assert types["multilora_time_to_first_token_seconds"] == "histogram"
    assert metric(ms, "multilora_requests_total", model="b") >= 1
    assert metric(ms, "multilora_generation_tokens_total", model="b") >= 3
    assert metric(ms, "multilora_kv_pages_total") == served.engine.pages.capacity
    assert metric(ms, "multilora_lora_slot_misses_total") >= 1
    # the pool: 4 slots at rank 16 (ENGINE_KW); "b" (and whatever else is resident) holds its
    # rank's pages of 8 rows
    resident = [e for e in served.engine.registry.entries.values() if e.slot is not None]
    assert metric(ms, "multilora_lora_pool_rows_total") == 4 * 16
    assert metric(ms, "multilora_lora_resident_adapters") == len(resident) >= 1
    assert metric(ms, "multilora_lora_pool_rows_used") == sum(-(-e.rank // 8) * 8 for e in resident)
    for h in ("multilora_time_to_first_token_seconds", "multilora_inter_token_latency_seconds"):
        buckets = sorted(((float(dict(k[1])["le"]), v) for k, v in ms.items()
                          if k != "__types__" and k[0] == f"{h}_bucket"), key=lambda t: t[0])
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == math.inf
        assert buckets[-1][1] == metric(ms, f"{h}_count") > 0


def _epp_view(text: str) -> dict:
    """What the Gateway API Inference Extension's endpoint picker reads from /metrics (its
    pkg/epp/backend/metrics): parsed by prometheus_client's own parser; of vllm:lora_requests_info
    the series with the largest value whose running and waiting lists are not both empty."""
    from prometheus_client.parser import text_string_to_metric_families
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    view = {}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:lora_requests_info"):
        assert name in fams and fams[name].type == "gauge", name
        view[name] = fams[name].samples
    busy = [s for s in view["vllm:lora_requests_info"]
            if s.labels["running_lora_adapters"] or s.labels["waiting_lora_adapters"]]
    for s in view["vllm:lora_requests_info"]:
        assert {"running_lora_adapters", "waiting_lora_adapters", "max_lora"} <= set(s.labels)
    view["picked"] = max(busy, key=lambda s: s.value).labels if busy else None
    return view


def test_gateway_metrics_have_vllm_names(served):
    """vllm:* gauges a LoRA-aware gateway routes by, with vLLM's meaning, through a real parser."""
    client = served.client()
    before = time.time()
    stream = client.completions.create(model="a", prompt=PROMPTS[1], stream=True, **greedy(max_tokens=120))
    next(iter(stream))
    during = _epp_view(served.metrics_text())
    list(stream)
    picked = during["picked"]
    assert picked is not None and picked["running_lora_adapters"].split(",") == ["a"]
    assert picked["max_lora"] == str(served.engine.registry.num_slots)
    wait_idle(served)
    idle = _epp_view(served.metrics_text())
    assert idle["vllm:num_requests_running"][0].value == 0 and idle["vllm:num_requests_waiting"][0].value == 0
    assert idle["vllm:kv_cache_usage_perc"][0].value == idle["vllm:gpu_cache_usage_perc"][0].value == 0
    # idle: the current series is empty (and newest); the picker keeps the last busy one, as it
    # would from vLLM's whole history of series
    series = idle["vllm:lora_requests_info"]
    assert len(series) == 2 and idle["picked"]["running_lora_adapters"] == "a"
    empty = [s for s in series if not s.labels["running_lora_adapters"]]
    assert len(empty) == 1 and empty[0].value >= max(s.value for s in series) >= before
    assert idle["vllm:num_requests_running"][0].labels["model_name"] == served.engine.model_name


def test_lora_requests_info_series():
    """The vllm:lora_requests_info series over a sequence of states (no server needed)."""
    from multilora.server.metrics import LoraInfo, Metrics
    m = Metrics("base")
    m.set_snapshot({}, {}, {}, LoraInfo([], [], 4, at=1.0))
    assert _epp_view(m.render())["picked"] is None
    m.set_snapshot({}, {}, {}, LoraInfo(["x", "y", "x"], ["z"], 4, at=2.0))
    v = _epp_view(m.render())
    assert len(v["vllm:lora_requests_info"]) == 1
    assert (v["picked"]["running_lora_adapters"], v["picked"]["waiting_lora_adapters"]) == ("x,y", "z")
    m.set_snapshot({}, {}, {}, LoraInfo([], [], 4, at=3.0))
    m.set_snapshot({}, {}, {}, LoraInfo([], ["w"], 4, at=4.0))
    v = _epp_view(m.render())
    assert v["picked"]["waiting_lora_adapters"] == "w" and len(v["vllm:lora_requests_info"]) == 1


def test_sigterm_drains_running_requests(served, tmp_path):
    """`multilora serve` in a subprocess: SIGTERM lets a running stream finish, then exits."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "multilora", "serve", "--model", str(served.model_dir), "--port", "0",
           "--max-loras-per-batch", "4", "--max-lora-rank", "16", "--max-num-seqs", "8",
           "--max-num-batched-tokens", "64", "--page-size", "8", "--max-model-len", str(MAX_MODEL_LEN),
           "--lora-modules", f"a={served.lora_root / ADAPTERS['a']}", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(Path(__file__).resolve().parents[1]), env=env)
    lines: list[str] = []
    url = None
    try:
        deadline = time.time() + 240
        while url is None:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the server exited:\n" + "".join(lines)
            lines.append(line)
            m = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
            url = m.group(1) if m else None
            assert time.time() < deadline, "the server did not start:\n" + "".join(lines)
        threading.Thread(target=lambda: [lines.append(ln) for ln in proc.stdout], daemon=True).start()
        # it answers once its first shapes are compiled, the rest compiling behind it (/health says how far)
        w = httpx.get(url + "/health", timeout=30).json()["warmup"]
        assert 0 < w["compiled"] <= w["total"]
        ref = served.refs[ref_key(PROMPTS[6], "a", 8 + 2 * 6)]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)
        stream = client.completions.create(model="a", prompt=PROMPTS[6], stream=True,
                                           stream_options={"include_usage": True}, **greedy(max_tokens=110))
        chunks = [next(iter(stream))]
        proc.send_signal(signal.SIGTERM)
        chunks += list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text.startswith(ref.text)  # the same greedy tokens...
        assert chunks[-1].usage.completion_tokens == 110  # ...and all of them
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        rc = proc.wait(timeout=60)
        assert rc in (0, -signal.SIGTERM), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_prefix_cache_hits_show_in_usage_and_metrics(served):
    """The same long chat twice (then streamed): the repeats report the cached prompt tokens in
    usage.prompt_tokens_details.cached_tokens, /metrics counts them, and the text is unchanged."""
    messages = [{"role": "system", "content": "once upon a time there was a little model " * 4},
                {"role": "user", "content": "tell me a story"}]
    body = dict(model="a", messages=messages, max_tokens=6, temperature=0, ignore_eos=True)
    before = served.metrics()
    with served.http() as c:
        first, second = (c.post("/v1/chat/completions", json=body).json() for _ in range(2))
        streamed = [json.loads(line[6:]) for line in c.post(
            "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
        ).text.splitlines() if line.startswith("data: {")]
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 2 * 8
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt_tokens - 1) // 8 * 8   # every full page but the last prompt token's
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert streamed[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    after = served.metrics()
    assert metric(after, "multilora_prefix_cache_hits_total") - metric(before, "multilora_prefix_cache_hits_total") \
        == 2 * cached
    assert metric(after, "multilora_prefix_cache_queries_total") \
        - metric(before, "multilora_prefix_cache_queries_total") == 3 * prompt_tokens


def test_nothing_is_silently_ignored(served):
    """An unknown field, or a known one the server does not act on set to anything but "off",
    is a 400 naming it; the "off" values clients send by default are accepted."""
    base = served.engine.model_name
    ok = dict(model=base, prompt="hello", max_tokens=4)
    chat = dict(model=base, messages=CHAT, max_tokens=4)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    refused = [
        ("/v1/completions", dict(ok, frobnicate=1), "frobnicate"),
        ("/v1/completions", dict(ok, response_format={"type": "xml"}), "response_format"),
        ("/v1/chat/completions", dict(chat, response_format=schema, guided_regex="a+"), "response_format"),
        ("/v1/completions", dict(ok, guided_decoding_backend="xgrammar", guided_regex="a+"),
         "guided_decoding_backend"),
        ("/v1/completions", dict(ok, structured_outputs={"xml": "<a/>"}), "structured_outputs"),
        ("/v1/chat/completions", dict(chat, tools=[{"type": "function", "function": {"name": "f", "x": 1}}]), "x"),
        ("/v1/chat/completions", dict(chat, tool_choice="required"), "tool_choice"),
        ("/v1/chat/completions", dict(chat, functions=[{"name": "f"}]), "functions"),
        ("/v1/completions", dict(ok, n=0), "n"),
        ("/v1/completions", dict(ok, n=129), "n"),
        ("/v1/completions", dict(ok, best_of=2, stream=True), "best_of"),
        ("/v1/completions", dict(ok, best_of=1, n=2), "best_of"),
        ("/v1/completions", dict(ok, suffix="!"), "suffix"),
        ("/v1/completions", dict(ok, guided_json={"type": "objectx"}), "guided_json"),
        ("/v1/completions", dict(ok, guided_regex="a(b"), "guided_regex"),
        ("/v1/completions", dict(ok, guided_choice=[]), "guided_choice"),
        ("/v1/chat/completions", dict(chat, response_format={"type": "json_schema", "json_schema": "x"}),
         "response_format"),
        ("/v1/completions", dict(ok, min_p=0.1), "min_p"),
        ("/v1/completions", dict(ok, logit_bias={"x": 1.0}), "logit_bias"),
        ("/v1/completions", dict(ok, presence_penalty=3.0), "presence_penalty"),
        ("/v1/chat/completions", dict(chat, messages=[{"role": "user", "content": "hi", "cache_control": {}}]),
         "cache_control"),
        ("/v1/chat/completions", dict(chat, messages=[{"role": "assistant", "content": "x",
                                                        "tool_calls": [{"id": "1"}]}]), "messages"),
    ]
    with served.http() as c:
        for route, body, param in refused:
            err = assert_error(c.post(route, json=body), 400)
            assert err["param"] == param and param in err["message"], (body, err)
        err = assert_error(c.post("/v1/completions", json=dict(ok, logit_bias={"99999": 1.0})), 400)
        assert "logit_bias" in err["message"] and "vocabulary" in err["message"], err
        # where the field is, as the client wrote it (no pydantic union tags); a part not of text by its type
        image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
        err = assert_error(c.post("/v1/chat/completions", json=dict(chat, messages=[
            {"role": "user", "content": [{"type": "text", "text": "see"}, image]}])), 400)
        assert err["message"].startswith("messages[0].content[1]: type 'image_url' is not supported"), err
        assert "text only" in err["message"] and err["param"] == "type", err
        err = assert_error(c.post("/v1/chat/completions", json=dict(chat, messages=[
            {"role": "user", "content": [{"type": "text", "text": "see", "x": 1}]}])), 400)
        assert err["message"].startswith("unknown field messages[0].content[0].x:"), err
        off = dict(chat, response_format={"type": "text"}, tool_choice="none", tools=[], n=1, store=False,
                   parallel_tool_calls=True, user="u", metadata={"k": "v"}, skip_special_tokens=True,
                   messages=CHAT + [{"role": "assistant", "content": "x", "tool_calls": None, "refusal": None},
                                    {"role": "user", "content": "more"}])
        r = c.post("/v1/chat/completions", json=off)
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json=dict(ok, echo=False, best_of=1, suffix=None, n=1))
        assert r.status_code == 200, r.text


STRUCTURED_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "n", "tag"],
                     "properties": {"color": {"enum": ["red", "green", "blue"]},
                                    "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                    "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"}}}


def test_structured_output_for_base_and_adapters_in_one_batch(served):
    """The openai client, unchanged: response_format json_schema for the base model and two
    adapters, concurrently, beside free rows whose tokens stay those of the offline reference;
    every constrained output parses and validates (jsonschema); vLLM's guided_* extras and
    json_object on completions; a streamed constrained output is the same JSON."""
    jsonschema = pytest.importorskip("jsonschema")
    from concurrent.futures import ThreadPoolExecutor
    client = served.client()
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": STRUCTURED_SCHEMA, "strict": True}}
    free = [(p, lora, 8 + 2 * (i % 7)) for i, p in enumerate(PROMPTS[:4]) for lora in (None, "a")]

    def constrained(lora, temperature):
        r = client.chat.completions.create(model=model_name(served, lora), messages=CHAT, max_tokens=96,
                                           temperature=temperature, seed=7, response_format=rf)
        return r.choices[0]

    def plain(job):
        prompt, lora, max_tokens = job
        r = client.completions.create(model=model_name(served, lora), prompt=prompt, **greedy(max_tokens=max_tokens))
        return job, r.choices[0].text

    with ThreadPoolExecutor(12) as pool:
        cons = [pool.submit(constrained, lora, t) for lora in (None, "a", "b") for t in (0.0, 1.0)]
        frees = [pool.submit(plain, j) for j in free]
        for f in frees:
            job, text = f.result()
            assert text == served.refs[ref_key(*job)].text, job
        for f in cons:
            choice = f.result()
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), STRUCTURED_SCHEMA)
    base = served.engine.model_name
    r = client.completions.create(model="b", prompt=PROMPTS[2], max_tokens=32, temperature=1.0, seed=3,
                                  extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert r.choices[0].text in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=base, prompt=PROMPTS[0], max_tokens=32, temperature=1.0, seed=4,
                                  extra_body={"guided_regex": r"[0-9]{3}-[a-c]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", r.choices[0].text), r.choices[0].text
    r = client.completions.create(model="a", prompt=PROMPTS[1], max_tokens=48, temperature=0.0,
                                  extra_body={"guided_json": STRUCTURED_SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].text), STRUCTURED_SCHEMA)
    r = client.completions.create(model="a", prompt=PROMPTS[1], max_tokens=48, temperature=0.0,
                                  extra_body={"structured_outputs": {"json": STRUCTURED_SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].text), STRUCTURED_SCHEMA)
    # json_object: any object; with a random model it may not close within max_tokens, but what
    # comes out is always a prefix of one
    r = client.completions.create(model=base, prompt=PROMPTS[3], max_tokens=24, temperature=0.0,
                                  extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    whole = constrained("b", 0.0).message.content
    stream = client.chat.completions.create(model="b", messages=CHAT, max_tokens=96, temperature=0.0, seed=7,
                                            response_format=rf, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole
    wait_idle(served)


def _log_softmax(logits):
    z = logits.astype(float) - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_echo_with_prompt_logprobs(served):
    """echo on /v1/completions, as lm-eval's loglikelihood uses it: max_tokens 0 scores the
    prompt alone (each token's logprob after the ones before it, the first null, top
    alternatives), equal to transformers + PEFT; with max_tokens > 0 the text is the prompt then
    the usual completion; streamed, the same text and logprobs; chat refuses echo with a 400."""
    client, tok = served.client(), served.engine.tokenizer
    prompt = PROMPTS[4]
    ids = tok.encode(prompt)
    for lora in (None, "a"):
        adapter = None if lora is None else served.lora_root / ADAPTERS[lora]
        ref = _log_softmax(reference.peft_logits(served.model_dir, adapter, ids))
        r = client.completions.create(model=model_name(served, lora), prompt=prompt, max_tokens=0, echo=True,
                                      logprobs=3, temperature=0.0)
        c = r.choices[0]
        assert c.text == prompt and c.finish_reason == "length" and r.usage.completion_tokens == 0
        lp = c.logprobs
        assert lp.tokens == [served_token(tok, t) for t in ids] and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        for j in range(1, len(ids)):
            assert abs(lp.token_logprobs[j] - ref[j - 1, ids[j]]) < 2e-4, (lora, j)
            want = np.sort(ref[j - 1])[::-1][:3]
            np.testing.assert_allclose(sorted(lp.top_logprobs[j].values(), reverse=True)[:len(lp.top_logprobs[j])],
                                       want[:len(lp.top_logprobs[j])], atol=2e-4)
    plain = client.completions.create(model="b", prompt=prompt, logprobs=2, **greedy(max_tokens=6))
    echoed = client.completions.create(model="b", prompt=prompt, logprobs=2, echo=True, **greedy(max_tokens=6))
    e = echoed.choices[0]
    assert e.text == prompt + plain.choices[0].text
    assert len(e.logprobs.tokens) == len(ids) + 6
    # the echo computed its whole prompt (no prefix-cache hit): equal up to float rounding
    np.testing.assert_allclose(e.logprobs.token_logprobs[len(ids):], plain.choices[0].logprobs.token_logprobs,
                               atol=1e-5)
    assert e.logprobs.text_offset[len(ids)] == len(prompt)
    chunks = list(client.completions.create(model="b", prompt=prompt, logprobs=2, echo=True, stream=True,
                                            **greedy(max_tokens=6)))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == e.text
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed == e.logprobs.token_logprobs
    with served.http() as h:
        err = assert_error(h.post("/v1/chat/completions", json=dict(model="a", messages=CHAT, echo=True)), 400)
        assert err["param"] == "echo"
    wait_idle(served)


def served_token(tok, token_id):
    return tok.decode([token_id], skip_special_tokens=False)


def test_every_documented_field_of_both_routes(served):
    """One request per route that sends every field its schema documents (an honoured value
    where the server acts on it, the "off" value where it does not; at most one output
    constraint set, the others null): 200, and the fields' effects show (stop, n, echo, logprobs,
    usage). A field added to the protocol without a value here fails this test."""
    from multilora.server import protocol as P
    base = served.engine.model_name
    shared = dict(temperature=0.7, top_p=0.9, n=2, stop=["zzz"], seed=5, stream=False, stream_options=None,
                  presence_penalty=0.1, frequency_penalty=0.1, logit_bias={"65": 1.0}, user="u", metadata={"k": "v"},
                  top_k=20, ignore_eos=True, stop_token_ids=[1], repetition_penalty=1.1, min_tokens=1, adapters=None,
                  response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": STRUCTURED_SCHEMA}},
                  guided_json=None, guided_regex=None, guided_choice=None, guided_grammar=None,
                  guided_decoding_backend="auto", structured_outputs=None, service_tier="auto", store=False,
                  prediction=None, use_beam_search=False, length_penalty=1.0, min_p=0.0, allowed_token_ids=None,
                  bad_words=[], prompt_logprobs=None, include_stop_str_in_output=False, skip_special_tokens=True,
                  spaces_between_special_tokens=True, truncate_prompt_tokens=None, priority=0)
    completion = dict(shared, model="a", prompt=PROMPTS[0], max_tokens=64, logprobs=2, echo=True, best_of=2, suffix=None)
    chat = dict(shared, model=base, messages=CHAT, max_tokens=None, max_completion_tokens=64, logprobs=True,
                top_logprobs=2, tools=None, tool_choice="none", parallel_tool_calls=None, functions=None,
                function_call=None, modalities=["text"], audio=None, reasoning_effort=None, web_search_options=None,
                add_generation_prompt=True, echo=False, continue_final_message=False, chat_template=None,
                chat_template_kwargs={}, documents=None, mm_processor_kwargs=None)
    assert set(completion) == set(P.CompletionRequest.model_fields)
    assert set(chat) == set(P.ChatCompletionRequest.model_fields)
    with served.http() as c:
        r = c.post("/v1/completions", json=completion)
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["choices"]) == 2 and body["usage"]["prompt_tokens"] > 0
        for ch in body["choices"]:
            assert ch["text"].startswith(PROMPTS[0]) and ch["logprobs"]["token_logprobs"][0] is None
            json.loads(ch["text"][len(PROMPTS[0]):])  # the constraint held
        r = c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["choices"]) == 2
        for ch in body["choices"]:
            json.loads(ch["message"]["content"])
            assert ch["logprobs"]["content"] and len(ch["logprobs"]["content"][0]["top_logprobs"]) == 2
    wait_idle(served)


def test_logit_bias_min_tokens_and_penalties_change_tokens_as_specified(served):
    """logit_bias +100 on one token makes greedy decoding emit only it; -100 on the greedy
    choice gives the runner-up (the unbiased run's second top logprob); min_tokens holds back
    a forced EOS; a presence penalty changes a greedy run that repeats tokens."""
    client, tok = served.client(), served.engine.tokenizer
    base = served.engine.model_name
    forced = 65
    r = client.completions.create(model="a", prompt=PROMPTS[1], logit_bias={str(forced): 100}, **greedy(max_tokens=5))
    assert r.choices[0].text == tok.decode([forced] * 5)
    plain = client.completions.create(model=base, prompt=PROMPTS[2], logprobs=2, **greedy(max_tokens=1))
    top = plain.choices[0].logprobs.top_logprobs[0]
    (first, _), (second, _) = sorted(top.items(), key=lambda kv: -kv[1])[:2]
    first_id = tok.encode(first, add_special_tokens=False)
    assert len(first_id) == 1
    r = client.completions.create(model=base, prompt=PROMPTS[2], logit_bias={str(first_id[0]): -100},
                                  **greedy(max_tokens=1))
    assert r.choices[0].text == second
    eos = 2  # <|im_end|>, the tiny config's eos
    r = client.completions.create(model="b", prompt=PROMPTS[3], temperature=0.0, max_tokens=8,
                                  logit_bias={str(eos): 100})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    r = client.completions.create(model="b", prompt=PROMPTS[3], temperature=0.0, max_tokens=8,
                                  logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 4
    plain = client.completions.create(model=base, prompt=PROMPTS[0], **greedy(max_tokens=24))
    ids = tok.encode(plain.choices[0].text, add_special_tokens=False)
    assert len(set(ids)) < len(ids), "the baseline should repeat a token for this check to bite"
    pen = client.completions.create(model=base, prompt=PROMPTS[0], presence_penalty=2.0, frequency_penalty=2.0,
                                    **greedy(max_tokens=24))
    assert pen.choices[0].text != plain.choices[0].text
    rep = client.completions.create(model=base, prompt=PROMPTS[0], extra_body={"repetition_penalty": 1.0,
                                    "ignore_eos": True}, temperature=0.0, max_tokens=24)
    assert rep.choices[0].text == plain.choices[0].text  # neutral values change nothing


def test_tokenize_and_detokenize(served):
    """vLLM's /tokenize and /detokenize (at /v1/ too): the ids the engine would see, for a prompt
    and for chat messages, and back; bad ids and unknown models refused."""
    base, tok = served.engine.model_name, served.engine.tokenizer
    with served.http() as c:
        for path in ("/v1/tokenize", "/tokenize"):
            r = c.post(path, json={"model": base, "prompt": PROMPTS[1]})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["tokens"] == tok.encode(PROMPTS[1]) and body["count"] == len(body["tokens"])
            assert body["max_model_len"] == MAX_MODEL_LEN
        r = c.post("/v1/tokenize", json={"model": "a", "messages": CHAT})
        assert r.status_code == 200 and r.json()["tokens"] == tok.encode_chat(
            [dict(m) for m in CHAT], True), r.text
        r = c.post("/v1/detokenize", json={"model": base, "tokens": tok.encode(PROMPTS[1])})
        assert r.status_code == 200 and r.json()["prompt"] == PROMPTS[1], r.text
        assert assert_error(c.post("/detokenize", json={"tokens": [1, 10**6]}), 400)["param"] == "tokens"
        assert_error(c.post("/v1/tokenize", json={"model": "nope", "prompt": "x"}), 404)
        assert assert_error(c.post("/v1/tokenize", json={"prompt": "x", "extra": 1}), 400)["param"] == "extra"


def test_n_choices_share_one_prefill(served):
    """n = 3 sampled choices of a long prompt: three distinct texts (seeded), indices 0..2, the
    prompt counted once in usage; the two followers take every full prompt page from the first
    choice's prefill (the prefix-cache hits grow by 2 x those pages, the queries by 3 prompts).
    Streamed, the choices interleave by index, each opening with its role delta."""
    messages = [{"role": "system", "content": "a little model that served many adapters at once " * 3},
                {"role": "user", "content": "tell me a story about dogs"}]
    body = dict(model="b", messages=messages, max_tokens=12, temperature=1.0, seed=7, n=3, ignore_eos=True)
    before = served.metrics()
    with served.http() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [ch["index"] for ch in out["choices"]] == [0, 1, 2]
    texts = [ch["message"]["content"] for ch in out["choices"]]
    assert len(set(texts)) == 3, texts
    prompt_tokens = out["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == 3 * 12
    full = (prompt_tokens - 1) // 8 * 8
    after = served.metrics()
    hits = metric(after, "multilora_prefix_cache_hits_total") - metric(before, "multilora_prefix_cache_hits_total")
    assert hits == 2 * full and full > 0, (hits, full)
    with served.http() as c:
        events = [json.loads(line[6:]) for line in c.post("/v1/chat/completions", json={**body, "stream": True})
                  .text.splitlines() if line.startswith("data: {")]
    by_index = {i: "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                           if e["choices"] and e["choices"][0]["index"] == i) for i in range(3)}
    assert [by_index[i] for i in range(3)] == texts  # the same seeds: the same three choices
    roles = [e["choices"][0]["index"] for e in events if e["choices"][0]["delta"].get("role")]
    assert sorted(roles) == [0, 1, 2]
    r = served.client().completions.create(model="a", prompt=[PROMPTS[0], PROMPTS[1]], n=2, temperature=0.0,
                                           max_tokens=4)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text  # greedy


def test_best_of_returns_the_highest_cumulative_logprob(served):
    """best_of = 3, n = 1: the choice returned is, of the three candidates (the same seeds give
    the same candidates as n = 3), the one whose chosen tokens' logprobs sum highest; usage
    counts every candidate's tokens, the prompt once."""
    client = served.client()
    kw = dict(model="a", prompt=PROMPTS[4], temperature=1.0, seed=11, max_tokens=8)
    cands = client.completions.create(n=3, logprobs=0, **kw)
    scores = [sum(ch.logprobs.token_logprobs) for ch in cands.choices]
    assert len({round(x, 4) for x in scores}) == 3, scores
    best = client.completions.create(best_of=3, **kw)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == cands.choices[max(range(3), key=lambda i: scores[i])].text
    assert best.usage.completion_tokens == sum(len(ch.logprobs.tokens) for ch in cands.choices)
    assert best.usage.prompt_tokens == cands.usage.prompt_tokens
    two = client.completions.create(best_of=3, n=2, logprobs=1, **kw)
    order = sorted(range(3), key=lambda i: -scores[i])[:2]
    assert [ch.text for ch in two.choices] == [cands.choices[i].text for i in order]
    assert [ch.index for ch in two.choices] == [0, 1]


def test_weighted_mix_over_http(served):
    """The `adapters` extra: the base model's name (or "mix") with {name: weight} runs the exact
    mix (tested against PEFT in test_engine); the same tokens as naming the registered mix;
    unknown parts are 404, a non-base model or a bad weight 400, all naming `adapters`."""
    base = served.engine.model_name
    client = served.client()
    kw = dict(prompt=PROMPTS[2], **greedy(max_tokens=6))
    r = client.completions.create(model=base, extra_body={"adapters": {"a": 0.5, "b": 0.5}, "ignore_eos": True},
                                  prompt=PROMPTS[2], temperature=0.0, max_tokens=6)
    again = client.completions.create(model="mix(a=0.5,b=0.5)", **kw)
    assert r.choices[0].text == again.choices[0].text
    assert r.choices[0].text != client.completions.create(model="a", **kw).choices[0].text
    assert "mix(a=0.5,b=0.5)" in [m.id for m in client.models.list().data]
    with served.http() as c:
        ok = dict(model=base, prompt="hello", max_tokens=2)
        assert assert_error(c.post("/v1/completions", json=dict(ok, adapters={"nope": 1.0})), 404)["param"] == "adapters"
        assert assert_error(c.post("/v1/completions", json=dict(ok, model="a", adapters={"b": 1.0})), 400)["param"] == "adapters"
        assert assert_error(c.post("/v1/chat/completions", json=dict(model="mix", messages=CHAT, adapters={})),
                            400)["param"] == "adapters"


def test_openapi_documents_every_route_body(served):
    """/openapi.json carries each route's request body and responses from the models the routes
    validate with (so /docs and schema-driven clients and fuzzers see the real fields)."""
    from multilora.server import protocol as P
    with served.http() as c:
        doc = c.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, model in (("/v1/completions", P.CompletionRequest), ("/v1/chat/completions", P.ChatCompletionRequest),
                        ("/v1/load_lora_adapter", P.LoadLoRAAdapterRequest), ("/v1/detokenize", P.DetokenizeRequest)):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model.__name__}"}
        assert set(schemas[model.__name__]["properties"]) == set(model.model_fields)
    tok = doc["paths"]["/v1/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert len(tok["oneOf"]) == 2
    ok = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/ChatCompletionResponse") and "text/event-stream" in ok
    assert doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"][
        "$ref"].endswith("/ModelList")
    assert doc["paths"]["/v1/completions"]["post"]["responses"]["400"]["content"]["application/json"]["schema"][
        "$ref"].endswith("/ErrorResponse")
    refs = set()

    def walk(x):
        if isinstance(x, dict):
            if "$ref" in x:
                refs.add(x["$ref"].rsplit("/", 1)[-1])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(doc)
    assert refs <= set(schemas), refs - set(schemas)  # every reference resolves


# ---- last: a fuzz of the whole API (it may unload the module's adapters) --------------------------
def test_schemathesis_finds_no_server_error(served, tmp_path):
    """A short, seeded schemathesis run over /openapi.json (every route, the schema's examples,
    its coverage cases and fuzzed bodies, valid and invalid): no 5xx and no hang; afterwards the
    server still serves and has leaked no KV page."""
    pytest.importorskip("schemathesis")
    exe = Path(sys.executable).with_name("schemathesis")
    cmd = [str(exe), "run", served.url + "/openapi.json", "--checks", "not_a_server_error",
           "--max-examples", "40", "--seed", "20261202", "--phases", "examples,coverage,fuzzing",
           "--header", f"Authorization: Bearer {API_KEY}", "--request-timeout", "60",
           "--generation-database", "none", "--no-shrink", "--workers", "1"]
    env = dict(os.environ, SCHEMATHESIS_TELEMETRY="false", NO_COLOR="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    with served.http() as c:
        assert c.get("/health").status_code == 200
        ok = c.post("/v1/completions", json=dict(model=served.engine.model_name, prompt="hello", max_tokens=4))
        assert ok.status_code == 200, ok.text
    wait_idle(served)


def test_load_inplace_over_http_and_which_weights_answered(served):
    """vLLM's load_inplace: the name serves the new folder's weights at once, with a prompt cached
    under the old ones; every response (and /v1/models) names the version that answered."""
    client = served.client()
    prompt, max_tokens = PROMPTS[0], 8
    with served.http() as c:
        assert c.post("/v1/load_lora_adapter", json=dict(lora_name="ip", lora_path=ADAPTERS["a"])).status_code == 200
        r1 = client.completions.create(model="ip", prompt=prompt, **greedy(max_tokens=max_tokens))
        assert r1.choices[0].text == served.refs[ref_key(prompt, "a", max_tokens)].text
        assert r1.system_fingerprint.startswith("v1-")
        r = c.post("/v1/load_lora_adapter", json=dict(lora_name="ip", lora_path=ADAPTERS["c"], load_inplace=True))
        assert r.status_code == 200, r.text
        versions = {m.id: getattr(m, "version", None) for m in client.models.list().data}
        assert versions["ip"].startswith("v2-") and versions["ip"] != r1.system_fingerprint
        r2 = client.completions.create(model="ip", prompt=prompt, **greedy(max_tokens=max_tokens))
        assert r2.choices[0].text == served.refs[ref_key(prompt, "c", max_tokens)].text
        assert r2.system_fingerprint == versions["ip"]
        chunks = list(client.chat.completions.create(model="ip", messages=CHAT, stream=True, **greedy(max_tokens=4)))
        assert chunks[-1].system_fingerprint == versions["ip"]
        base = client.completions.create(model=served.engine.model_name, prompt=prompt, **greedy(max_tokens=2))
        assert base.system_fingerprint is None
        assert c.post("/v1/unload_lora_adapter", json=dict(lora_name="ip")).status_code == 200
