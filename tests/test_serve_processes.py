"""`multilora serve` across two processes (jax.distributed over gloo on 127.0.0.1, one CPU device
each, one tp=2 engine): process 0 serves HTTP, process 1 follows. The tokens equal one process's,
a runtime load and unload reach both (with the model split over the two, a follower without the
adapter would compute half of every layer wrong), SIGTERM stops both cleanly, and a follower that
dies stops the server with an error naming it instead of a hang."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import reference
from tests.procs import child_env, free_port

httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[1]
KW = dict(max_loras_per_batch=4, max_lora_rank=16, max_num_seqs=2, max_num_batched_tokens=16, page_size=8,
          max_model_len=64)   # few step shapes: two processes compile on two cores
PROMPTS = ["hello world", "once upon a time there was", "tell me a story about cats", "how are you today?"]
ADAPTERS = {"a": "a_all_r8", "b": "b_attn_r4_rslora", "c": "c_mlp_r16"}   # c: loaded at run time
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The model, its adapters, and one process's greedy texts for every (prompt, adapter)."""
    from multilora.engine.engine import Engine
    from multilora.engine.request import SamplingParams
    root = tmp_path_factory.mktemp("serve_mp")
    model_dir = reference.make_tokenized_tiny_model(root / "model")
    paths = {name: str(reference.make_adapter(model_dir, root / "adapters" / spec, seed=21 + i,
                                              **reference.ADAPTER_SPECS[spec]))
             for i, (name, spec) in enumerate(ADAPTERS.items())}
    engine = Engine(str(model_dir), paths, **KW, warmup=False)   # the references: what they use compiles
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    refs = {(p, lora): engine.generate(p, params, lora=lora)[0].text
            for p in PROMPTS for lora in (None, "a", "b", "c")}
    return dict(model_dir=model_dir, paths=paths, refs=refs, base=model_dir.name)


class _Proc:
    """One `multilora serve` process and its output lines (read on a thread)."""

    def __init__(self, setup, pid: int, coordinator: str, log_dir: Path):
        args = [sys.executable, "-m", "multilora", "serve", "--model", str(setup["model_dir"]),
                "--lora-modules", f"a={setup['paths']['a']}", f"b={setup['paths']['b']}",
                "--allow-any-lora-path", "--port", "0", "--log-level", "warning",
                "--tensor-parallel-size", "2", "--coordinator-address", coordinator, "--num-processes", "2",
                "--process-id", str(pid), "--drain-timeout", "5"]
        for k, v in KW.items():
            args += ["--" + k.replace("_", "-"), str(v)]
        env = child_env()
        self.stderr_path = log_dir / f"serve{pid}.err"
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=open(self.stderr_path, "w"), text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, f"exited ({self.proc.returncode}): {self.stderr()[-3000:]}"
                continue
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r} within {timeout}s; stderr: {self.stderr()[-3000:]}")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture
def two_processes(setup, tmp_path):
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [_Proc(setup, pid, coordinator, tmp_path) for pid in range(2)]
    try:
        t0 = time.time()
        line = procs[0].wait_for("serving on http://", timeout=600)
        print(f"two serve processes up in {time.time() - t0:.0f} s")
        procs[1].wait_for("follows process 0", timeout=60)
        yield procs, line.split("serving on ", 1)[1].strip().removesuffix("/v1")
    finally:
        for p in procs:
            p.kill()


def _complete(url: str, prompt: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json=dict(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))


def test_two_serve_processes_match_one(setup, two_processes):
    procs, url = two_processes
    model = lambda lora: lora or setup["base"]  # noqa: E731
    jobs = [(p, lora) for p in PROMPTS for lora in (None, "a", "b")]
    with ThreadPoolExecutor(8) as pool:  # concurrent: batches of several adapters
        outs = list(pool.map(lambda j: _complete(url, j[0], model(j[1])), jobs))
    for (prompt, lora), r in zip(jobs, outs):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == setup["refs"][(prompt, lora)], (prompt, lora)

    # a runtime load reaches the follower too (else its half of each layer would be wrong)
    r = httpx.post(url + "/v1/load_lora_adapter", json=dict(lora_name="c", lora_path=setup["paths"]["c"]))
    assert r.status_code == 200, r.text
    for prompt in PROMPTS[:2]:
        r = _complete(url, prompt, "c")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == setup["refs"][(prompt, "c")]
    assert httpx.post(url + "/v1/unload_lora_adapter", json=dict(lora_name="c")).status_code == 200
    assert _complete(url, PROMPTS[0], "c").status_code == 404
    assert _complete(url, PROMPTS[0], "a").json()["choices"][0]["text"] == setup["refs"][(PROMPTS[0], "a")]

    # SIGTERM on process 0: it drains, then lets the follower stop; both exit cleanly
    procs[0].proc.send_signal(signal.SIGTERM)
    assert procs[0].proc.wait(timeout=120) == 0, procs[0].stderr()[-3000:]
    assert "Traceback" not in procs[0].stderr(), procs[0].stderr()[-3000:]
    procs[1].wait_for("process 0 has stopped", timeout=60)
    assert procs[1].proc.wait(timeout=120) == 0, procs[1].stderr()[-3000:]


def test_a_dead_follower_stops_the_server_with_an_error(setup, two_processes):
    procs, url = two_processes
    assert _complete(url, PROMPTS[1], "a").status_code == 200
    procs[1].proc.kill()
    t0 = time.time()
    code = procs[0].proc.wait(timeout=120)   # not a hang
    took = time.time() - t0
    err = procs[0].stderr()
    assert code == 1, err[-3000:]
    assert "the server stopped" in err and "process 1" in err, err[-3000:]
    assert took < 60, took
