"""Faults and load on the CPU, against a real uvicorn server in this process over a tiny random
Llama: the KV pool exhausted by long prompts, clients that stop reading or vanish, 1,000
concurrent connections, and an engine thread that dies or whose steps keep failing. Each test
prints its figure; docs/faults.md keeps them (the Ray faults are in tests/test_ray_serve.py).

One server (a small KV pool, a queue for 1,000) serves the first tests; the engine-death tests
each build their own engine, since they end it. The offline references come from the shared
Engine itself, one request at a time, before the server starts.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest

from tests import reference
from tests.test_server import metric, parse_metrics, serve_in_thread

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

PAGE = 8
NUM_PAGES = 64                  # 512 token slots: two long requests hold their pages at once, not three
# Shapes compile on first use (warmup=False: a full warm-up takes minutes here); few rows and
# tokens a step keep their number small, so that the tests after the first meet compiled ones.
ENGINE_KW = dict(max_loras_per_batch=2, max_lora_rank=8, max_num_seqs=8, max_num_batched_tokens=64,
                 page_size=PAGE, num_pages=NUM_PAGES, max_model_len=256, warmup=False)
SHORT = ["hello world", "once upon a time there was", "tell me a story about cats", "how are you today?"]
LONG_PROMPT_TOKENS, LONG_MAX_TOKENS, NUM_LONG = 150, 32, 8  # each needs 23 of the 64 pages; 8 want 184
SLOW_MAX_TOKENS = 200
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


def greedy(n: int):
    from multilora.engine.request import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def long_prompts() -> list[list[int]]:
    rng = np.random.default_rng(61)
    return [[int(t) for t in rng.integers(3, 256, LONG_PROMPT_TOKENS)] for _ in range(NUM_LONG)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    model = reference.make_tokenized_tiny_model(root / "model")
    adapter = reference.make_adapter(model, root / "a", seed=3, **reference.ADAPTER_SPECS["a_all_r8"])
    return model, adapter


@pytest.fixture(scope="module")
def served(model_dir):
    from multilora.engine.engine import Engine
    from multilora.server.app import build_app
    from multilora.server.async_engine import AsyncEngine

    model, adapter = model_dir
    engine = Engine(str(model), {"a": str(adapter)}, **ENGINE_KW)
    refs = {}
    for prompt in SHORT:
        for lora in (None, "a"):
            refs[(prompt, lora)] = engine.generate(prompt, greedy(2), lora=lora)[0].text
    for i, ids in enumerate(long_prompts()):
        refs[("long", i)] = engine.generate(ids, greedy(LONG_MAX_TOKENS), lora="a" if i % 2 else None)[0].text
    chat_ids = engine.tokenizer.encode_chat(CHAT)
    refs["chat"] = engine.generate(chat_ids, greedy(SLOW_MAX_TOKENS))[0].text
    refs["story"] = engine.generate(SHORT[2], greedy(64), lora="a")[0].text
    assert engine.stats["preemptions"] == 0 and not engine.has_unfinished()
    aengine = AsyncEngine(engine, max_queue=2048)
    server, thread, url = serve_with_small_send_buffers(build_app(aengine))
    yield Served(url=url, engine=engine, aengine=aengine, refs=refs, base=engine.model_name)
    server.should_exit = True
    thread.join(timeout=30)


def serve_with_small_send_buffers(app) -> tuple["uvicorn.Server", threading.Thread, str]:
    """uvicorn on a free local port whose connections have 4 KiB kernel send buffers (accepted
    sockets inherit the listener's): a client that stops reading then holds its response's
    writer after some 80 KiB (asyncio's 64 KiB write buffer, then the kernel's), not after the
    megabytes Linux's buffer autotuning would otherwise take on loopback."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=10,
                                           backlog=2048))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def wait_idle(served, timeout=30.0) -> None:
    """Until nothing runs or waits and no KV page is held by a request (cached pages may stay)."""
    deadline = time.monotonic() + timeout
    while served.engine.has_unfinished() or served.engine.pages.num_used:
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.05)


def percentile(values, q) -> float:
    return float(np.percentile(np.asarray(values), q))


# ---- the KV pool exhausted ---------------------------------------------------------------------------
def test_long_prompts_beyond_the_kv_pool_are_preempted_and_all_complete_with_their_tokens(served):
    """8 concurrent 150-token prompts, each wanting 23 of the pool's 64 pages (two fit): the scheduler
    preempts (and later recomputes) requests instead of failing any, and every one gets the same
    greedy tokens as when it ran alone; no page is lost."""
    engine = served.engine
    preempted0 = engine.stats["preemptions"]

    async def one(client, i, ids):
        r = await client.post("/v1/completions", json=dict(
            model="a" if i % 2 else served.base, prompt=ids, max_tokens=LONG_MAX_TOKENS, temperature=0.0,
            ignore_eos=True))
        return r.status_code, r.json()

    async def main():
        async with httpx.AsyncClient(base_url=served.url, timeout=TIMEOUT) as client:
            return await asyncio.gather(*(one(client, i, ids) for i, ids in enumerate(long_prompts())))

    t0 = time.monotonic()
    results = asyncio.run(main())
    wall = time.monotonic() - t0
    for i, (status, body) in enumerate(results):
        assert status == 200, body
        assert body["choices"][0]["text"] == served.refs[("long", i)], i
        assert body["usage"]["completion_tokens"] == LONG_MAX_TOKENS
    preemptions = engine.stats["preemptions"] - preempted0
    wait_idle(served)
    engine.pages.check_invariants()
    print(f"KV pool of {NUM_PAGES} pages, {NUM_LONG} requests needing {NUM_LONG * 23}: {preemptions} preemptions, "
          f"all {NUM_LONG} complete with their greedy tokens in {wall:.1f} s")
    assert preemptions > 0, "the pool was not exhausted: nothing was preempted"


# ---- clients that read slowly or vanish --------------------------------------------------------------
def _capture_streams(served, monkeypatch) -> list:
    """The RequestStreams the server submits from now on (in order)."""
    captured, submit = [], served.aengine.submit

    async def capturing(*args, **kw):
        stream = await submit(*args, **kw)
        captured.append(stream)
        return stream

    monkeypatch.setattr(served.aengine, "submit", capturing)
    return captured


def _small_window_client(served) -> "httpx.Client":
    """A client whose socket takes 4 KiB before the server's writes must wait for it to read."""
    transport = httpx.HTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)])
    return served.http(transport=transport)


def _chat_body(max_tokens: int) -> dict:
    # top-20 logprobs make each chunk ~1.6 KB: the stream outgrows the buffers between the two
    return dict(model=None, messages=CHAT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                logprobs=True, top_logprobs=20, stream=True)


def _stream_text(served, model, prompt, max_tokens, out: dict) -> None:
    t0 = time.monotonic()
    with served.http() as c:
        with c.stream("POST", "/v1/completions", json=dict(model=model, prompt=prompt, max_tokens=max_tokens,
                                                           temperature=0.0, ignore_eos=True, stream=True)) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    out.update(status=r.status_code, events=events, seconds=time.monotonic() - t0,
               text="".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]))


def _read_chat(served, body, out: dict) -> None:
    with served.http() as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            out["events"] = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_a_client_that_stops_reading_holds_up_nobody(served, monkeypatch):
    """A chat stream (~1.6 KB a token) whose client reads its first chunk and then nothing: its
    writer blocks on the full socket, yet the engine generates all its tokens (they wait in the
    request's queue) and another stream runs to the end meanwhile; when the client reads again it
    gets every token, as generated alone. The figure: the other stream's time beside the stalled
    client against alone."""
    captured = _capture_streams(served, monkeypatch)
    body = _chat_body(SLOW_MAX_TOKENS) | {"model": served.base}
    warm, reader = {}, {}            # the same pair read at once first: its shapes compiled (a
    pair = [threading.Thread(target=_read_chat, args=(served, body, reader)),    # compile would stall both)
            threading.Thread(target=_stream_text, args=(served, "a", SHORT[2], 64, warm))]
    for t in pair:
        t.start()
    for t in pair:
        t.join(TIMEOUT)
    assert reader["events"][-1] == "[DONE]" and warm["text"] == served.refs["story"]
    alone = {}
    _stream_text(served, "a", SHORT[2], 64, alone)   # the other stream's pace on its own
    assert alone["text"] == served.refs["story"]
    with _small_window_client(served) as slow:
        with slow.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            stalled = captured[-1]
            beside = {}
            other = threading.Thread(target=_stream_text, args=(served, "a", SHORT[2], 64, beside))
            other.start()
            other.join(TIMEOUT)
            assert not other.is_alive(), "the other stream waited for the stalled client"
            assert beside["status"] == 200 and beside["text"] == served.refs["story"]
            deadline = time.monotonic() + TIMEOUT
            while not stalled.done:       # the engine finishes the stalled client's request too
                assert time.monotonic() < deadline, "the engine waited for the stalled client"
                time.sleep(0.02)
            waiting = stalled.queue.qsize()
            # its writer was held by the socket: deltas it has not taken yet
            assert waiting > SLOW_MAX_TOKENS // 4, f"only {waiting} deltas waited: the client was not stalled"
            rest = [line for line in lines if line.startswith("data: ")]
    events = [first[6:]] + [line[6:] for line in rest]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == served.refs["chat"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    size = sum(len(e) for e in events)
    print(f"stalled reader: {size / 1024:.0f} KiB of stream, {waiting} of its {SLOW_MAX_TOKENS} deltas waiting on "
          f"its socket when the engine had finished it; the other stream's 64 tokens took {beside['seconds']:.2f} s "
          f"beside it, {alone['seconds']:.2f} s alone")
    wait_idle(served)


def test_a_client_that_vanishes_mid_stream_is_aborted_and_its_pages_freed(served, monkeypatch):
    """A stalled chat stream whose client then closes the connection: the server sees the
    disconnect although its writer is blocked, aborts the request before it ends, and its KV
    pages go back; a stream beside it is untouched."""
    captured = _capture_streams(served, monkeypatch)
    aborted0 = metric(served.metrics(), "multilora_requests_finished_total", model=served.base, finish_reason="abort")
    step = served.engine.step

    def slow_step():   # 20 ms a step: the 200 tokens outlast the client's few steps of reading
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(served.engine, "step", slow_step)
    gate, held = threading.Event(), threading.Event()

    def hold(engine):
        held.set()
        gate.wait(TIMEOUT)

    with _small_window_client(served) as c:
        with c.stream("POST", "/v1/chat/completions", json=_chat_body(SLOW_MAX_TOKENS) | {"model": served.base}) as r:
            data = (line for line in r.iter_lines() if line.startswith("data: "))
            next(data), next(data)   # the role chunk, then the first token's
            gone = captured[-1]
            # hold the engine between two steps, so that the request is surely unfinished when it goes
            holder = threading.Thread(target=lambda: asyncio.run(served.aengine.call(hold)))
            holder.start()
            assert held.wait(TIMEOUT)
            assert not gone.done and gone.num_tokens < SLOW_MAX_TOKENS
    beside = {}
    try:
        deadline = time.monotonic() + TIMEOUT
        while not gone.finished:              # the server saw the client go and aborted the stream
            assert time.monotonic() < deadline, "the vanished client's request was not aborted"
            time.sleep(0.02)
        other = threading.Thread(target=_stream_text, args=(served, "a", SHORT[2], 64, beside))
        other.start()
    finally:
        gate.set()
        holder.join(TIMEOUT)
    other.join(TIMEOUT)
    assert beside["text"] == served.refs["story"]
    wait_idle(served)
    assert gone.num_tokens < SLOW_MAX_TOKENS and gone.finish_reason == "abort"
    ms = served.metrics()
    assert metric(ms, "multilora_requests_finished_total", model=served.base, finish_reason="abort") == aborted0 + 1
    assert served.engine.pages.num_used == 0
    served.engine.pages.check_invariants()
    print(f"vanished client: aborted after {gone.num_tokens} of its {SLOW_MAX_TOKENS} tokens (its writer blocked), "
          f"its pages freed; the stream beside it took {beside['seconds']:.2f} s for 64 tokens")


# ---- 1,000 concurrent connections --------------------------------------------------------------------
N_CONNECTIONS = 1000


async def _one_connection(host, port, body: bytes) -> tuple:
    """One HTTP/1.1 request on its own connection, opened before any request is sent."""
    reader, writer = await asyncio.open_connection(host, port)
    return reader, writer, body


async def _exchange(reader, writer, body: bytes) -> tuple[int, dict, float]:
    t0 = time.perf_counter()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    raw = await reader.read()      # to the end: the server closes after its response
    seconds = time.perf_counter() - t0
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    return status, json.loads(payload) if payload else {}, seconds


def test_a_thousand_concurrent_connections_are_all_answered(served):
    """1,000 connections opened at once, then a completion (2 tokens, base or adapter) sent on
    each: every one answered 200 with its greedy tokens, none dropped; the wall time and the
    latency percentiles are the figure."""
    host, port = served.url.removeprefix("http://").split(":")
    jobs = [(SHORT[i % len(SHORT)], "a" if i % 3 == 0 else None) for i in range(N_CONNECTIONS)]
    bodies = [json.dumps(dict(model=lora or served.base, prompt=p, max_tokens=2, temperature=0.0,
                              ignore_eos=True)).encode() for p, lora in jobs]

    async def main():
        conns = await asyncio.gather(*(_one_connection(host, int(port), b) for b in bodies))
        t0 = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(_exchange(*c) for c in conns)), 300)
        return results, time.perf_counter() - t0

    results, wall = asyncio.run(main())
    bad = [(i, s, b) for i, (s, b, _) in enumerate(results) if s != 200]
    assert not bad, f"{len(bad)} of {N_CONNECTIONS} failed, first: {bad[:3]}"
    for (prompt, lora), (_, body, _) in zip(jobs, results):
        assert body["choices"][0]["text"] == served.refs[(prompt, lora)], (prompt, lora)
    lat = [s for _, _, s in results]
    print(f"{N_CONNECTIONS} concurrent connections, 2 tokens each: all answered in {wall:.1f} s "
          f"({N_CONNECTIONS / wall:.0f} requests/s); latency p50 {percentile(lat, 50):.2f} s, "
          f"p99 {percentile(lat, 99):.2f} s, max {max(lat):.2f} s")
    wait_idle(served)


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
    died = []

    def boom(*args, **kw):
        died.append(time.monotonic())
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
            events = [line[6:] for line in lines if line.startswith("data: ")]
            stream_ended = time.monotonic() - died[0]
            t.join(TIMEOUT)
            answered = time.monotonic() - died[0]
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
