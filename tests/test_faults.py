"""Faults on the CPU, against a real uvicorn server in this process over a tiny random Llama: an
engine thread that dies, or whose steps keep failing. Each test builds its own engine, since it
ends it.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests import reference
from tests.test_server import parse_metrics, serve_in_thread

httpx = pytest.importorskip("httpx")

# Shapes compile on first use (warmup=False: a full warm-up takes minutes here)
ENGINE_KW = dict(max_loras_per_batch=2, max_lora_rank=8, max_num_seqs=8, max_num_batched_tokens=64,
                 page_size=8, num_pages=64, max_model_len=256, warmup=False)
SHORT = ["hello world", "once upon a time there was", "tell me a story about cats", "how are you today?"]
CHAT = [{"role": "user", "content": "tell me a story about cats and dogs"}]
TIMEOUT = 60                    # every client call: a hang fails the test instead of the run


class Served:
    def __init__(self, **kw):
        self.__dict__.update(kw)

    def http(self, **kw) -> "httpx.Client":
        kw.setdefault("timeout", TIMEOUT)
        return httpx.Client(base_url=self.url, **kw)

    def metrics(self) -> dict:
        with self.http() as c:
            return parse_metrics(c.get("/metrics").text)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    model = root / "model"
    model.mkdir()
    reference.make_tiny_tokenizer(model)
    reference.make_tiny_model(model, "llama")
    adapter = reference.make_adapter(model, root / "a", seed=3, **reference.ADAPTER_SPECS["a_all_r8"])
    return model, adapter


# ---- an engine thread that dies ----------------------------------------------------------------------
@pytest.fixture
def fresh(model_dir):
    """A server over an engine of its own (these tests end it)."""
    from multilora.engine.engine import Engine
    from multilora.server.app import build_app
    from multilora.server.async_engine import AsyncEngine

    model, adapter = model_dir
    engine = Engine(str(model), {"a": str(adapter)}, **ENGINE_KW)
    aengine = AsyncEngine(engine, max_queue=64)
    server, thread, url = serve_in_thread(build_app(aengine))
    yield Served(url=url, engine=engine, aengine=aengine, base=engine.model_name)
    server.should_exit = True
    thread.join(timeout=30)


def _error(r, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err["message"]


def test_an_engine_thread_that_dies_says_why_to_every_request_and_to_health(fresh, monkeypatch):
    """An exception on the engine thread outside a step (here: in its metrics) ends the thread.
    The stream in flight ends with an error event and [DONE], the request in flight gets a 500,
    every later request and /health a 503, each with the reason; a request that passed the
    running check just before the end is answered too, nothing hangs."""
    def boom(*args, **kw):
        raise RuntimeError("injected: metrics failed")

    with fresh.http() as c:
        assert c.get("/health").status_code == 200
        with c.stream("POST", "/v1/completions", json=dict(model="a", prompt=SHORT[0], max_tokens=200,
                                                           ignore_eos=True, stream=True)) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            inflight = {}

            def post():
                with fresh.http() as c2:
                    inflight["r"] = c2.post("/v1/completions", json=dict(model=fresh.base, prompt=SHORT[1],
                                                                         max_tokens=200, ignore_eos=True))
            t = threading.Thread(target=post)
            t.start()
            deadline = time.monotonic() + TIMEOUT
            while fresh.engine.num_running < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            monkeypatch.setattr(fresh.aengine.metrics, "tokens_generated", boom)
            died = time.monotonic()
            events = [line[6:] for line in lines if line.startswith("data: ")]
            stream_ended = time.monotonic() - died
            t.join(TIMEOUT)
            answered = time.monotonic() - died
        assert events[-1] == "[DONE]" and "injected: metrics failed" in json.loads(events[-2])["error"]["message"]
        assert "injected: metrics failed" in _error(inflight["r"], 500)
        for method, path, body in (("POST", "/v1/completions", dict(model="a", prompt="x", max_tokens=2)),
                                   ("POST", "/v1/chat/completions", dict(model="a", messages=CHAT, max_tokens=2)),
                                   ("POST", "/v1/unload_lora_adapter", dict(lora_name="a")),
                                   ("GET", "/health", None)):
            msg = _error(c.request(method, path, json=body), 503)
            assert "the engine is not running" in msg and "injected: metrics failed" in msg, (path, msg)
        # a request that passed the running check just before the thread ended
        monkeypatch.setattr(fresh.aengine, "_check_running", lambda: None)
        assert "injected" in _error(c.post("/v1/completions", json=dict(model="a", prompt="x", max_tokens=2)), 503)
    assert fresh.aengine.num_inflight == 0
    print(f"engine thread died: its stream ended {stream_ended * 1000:.0f} ms after, the request in flight "
          f"answered (500) within {answered * 1000:.0f} ms; later requests and /health 503, with the reason")


def test_steps_that_keep_failing_turn_health_unhealthy(fresh, monkeypatch):
    """One failed step fails its requests (500, with the reason) and the engine goes on; when
    every step fails, the third in a row ends the engine thread: from then on /health and every
    request answer 503 with the reason (a supervisor or Ray Serve's health check replaces it)."""
    from multilora.server.async_engine import MAX_STEP_FAILURES

    def broken():
        raise RuntimeError("injected: the device is gone")

    monkeypatch.setattr(fresh.engine, "step", broken)
    body = dict(model="a", prompt=SHORT[0], max_tokens=2)
    with fresh.http() as c:
        for i in range(MAX_STEP_FAILURES):
            assert c.get("/health").status_code == 200, i
            assert "injected: the device is gone" in _error(c.post("/v1/completions", json=body), 500)
        deadline = time.monotonic() + TIMEOUT
        while fresh.aengine.is_alive:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for r in (c.get("/health"), c.post("/v1/completions", json=body)):
            msg = _error(r, 503)
            assert f"{MAX_STEP_FAILURES} engine steps in a row failed" in msg and "the device is gone" in msg
    assert fresh.engine.pages.num_used == 0
