"""Prometheus metrics, written by hand in the text exposition format (version 0.0.4): no client
library needed. Counters and histograms are updated by the engine thread and the HTTP handlers
(under one lock); gauges come from a snapshot the engine thread takes after every step, so that
/metrics never touches the engine itself.

Beside multilora's own names, the gauges that LoRA-aware gateways read are exported under vLLM's
names with vLLM's meaning (the Kubernetes Gateway API Inference Extension's endpoint picker, and
llm-d's, scrape them: pkg/epp/backend/metrics in kubernetes-sigs/gateway-api-inference-extension):
`vllm:num_requests_waiting`, `vllm:num_requests_running`, the KV cache usage as a fraction
(`vllm:kv_cache_usage_perc`, and its older name `vllm:gpu_cache_usage_perc`, which the reference
picker reads), and `vllm:lora_requests_info`. The last is a gauge whose labels carry the state
(`running_lora_adapters` and `waiting_lora_adapters`: comma-separated names of the adapters with
running / waiting requests; `max_lora`: how many adapters one batch can hold) and whose value is
the Unix time at which that state was seen: the picker takes the series with the largest value
and skips one whose two lists are both empty. vLLM keeps every label combination it ever
exported; here there are at most two series, the current state and the last non-empty one (what
the picker would pick from vLLM's whole history).
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from typing import Iterable, Optional

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5)
MAX_MODEL_LABELS = 256          # per-model histograms kept; the rest are counted under OTHER_MODELS
OTHER_MODELS = "(other)"
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return "{" + body + "}" if body else ""


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v))


class _Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)   # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1


class Metrics:
    """Everything /metrics reports. `model` labels are the served names: the base model's or an
    adapter's (what the client put in `model`)."""

    def __init__(self, base_name: str):
        self.base_name = base_name
        self._lock = threading.Lock()
        self.requests: dict[str, int] = {}                       # model -> accepted requests
        self.finished: dict[tuple[str, str], int] = {}           # (model, finish_reason) -> count
        self.rejected: dict[str, int] = {}                       # reason -> count
        self.prompt_tokens: dict[str, int] = {}
        self.generation_tokens: dict[str, int] = {}
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        # per served model (base or adapter): bounded, so that thousands of adapters cannot grow
        # /metrics without end; models beyond the bound share the label OTHER_MODELS
        self.ttft_by_model: dict[str, _Histogram] = {}
        self.itl_by_model: dict[str, _Histogram] = {}
        self.e2e = _Histogram(E2E_BUCKETS)
        self.gauges: dict[str, float] = {}                       # from the engine thread's snapshot
        self.adapter_stats: dict[str, int] = {}
        self.scheduler_stats: dict[str, int] = {}                # prefix-cache token counters
        self.lora_info: Optional[LoraInfo] = None                # vllm:lora_requests_info, now
        self.lora_info_busy: Optional[LoraInfo] = None           # ... the last one with adapters listed
        self.spec_stats: Optional[dict] = None                   # speculative decoding's counters (on only)

    def _model(self, lora: Optional[str]) -> str:
        return lora if lora is not None else self.base_name

    # ---- updates ---------------------------------------------------------------------------
    def request_accepted(self, lora: Optional[str], prompt_tokens: int) -> None:
        m = self._model(lora)
        with self._lock:
            self.requests[m] = self.requests.get(m, 0) + 1
            self.prompt_tokens[m] = self.prompt_tokens.get(m, 0) + prompt_tokens

    def request_rejected(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def tokens_generated(self, lora: Optional[str], n: int, ttft: Optional[float],
                         itl: Optional[float]) -> None:
        m = self._model(lora)
        with self._lock:
            self.generation_tokens[m] = self.generation_tokens.get(m, 0) + n
            if ttft is not None:
                self.ttft.observe(ttft)
                self._per_model(self.ttft_by_model, m, TTFT_BUCKETS).observe(ttft)
            if itl is not None:
                self.itl.observe(itl)
                self._per_model(self.itl_by_model, m, ITL_BUCKETS).observe(itl)

    @staticmethod
    def _per_model(table: dict[str, _Histogram], model: str, bounds) -> _Histogram:
        h = table.get(model)
        if h is None:
            if len(table) >= MAX_MODEL_LABELS:
                model = OTHER_MODELS
                h = table.get(model)
            if h is None:
                h = table[model] = _Histogram(bounds)
        return h

    def request_finished(self, lora: Optional[str], reason: Optional[str], e2e: float) -> None:
        key = (self._model(lora), reason or "unknown")
        with self._lock:
            self.finished[key] = self.finished.get(key, 0) + 1
            self.e2e.observe(e2e)

    def set_snapshot(self, gauges: dict[str, float], adapter_stats: dict[str, int],
                     scheduler_stats: Optional[dict[str, int]] = None,
                     lora_info: Optional["LoraInfo"] = None, spec_stats: Optional[dict] = None) -> None:
        with self._lock:
            self.spec_stats = spec_stats
            self.gauges = dict(gauges)
            self.adapter_stats = dict(adapter_stats)
            self.scheduler_stats = dict(scheduler_stats or {})
            if lora_info is not None:
                self.lora_info = lora_info
                if lora_info.running or lora_info.waiting:
                    self.lora_info_busy = lora_info

    # ---- exposition ------------------------------------------------------------------------
    def render(self) -> str:
        out: list[str] = []

        def family(name: str, kind: str, help_: str, samples: list[tuple[str, dict, float]]):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for suffix, labels, value in samples:
                out.append(f"{name}{suffix}{_labels(labels.items())} {_num(value)}")

        def hist_samples(h: _Histogram, labels: dict) -> list:
            samples, acc = [], 0
            for bound, c in zip(list(h.bounds) + [math.inf], h.counts):
                acc += c
                samples.append(("_bucket", {**labels, "le": _num(float(bound))}, acc))
            samples.append(("_sum", labels, h.sum))
            samples.append(("_count", labels, h.count))
            return samples

        def hist(name: str, help_: str, h: _Histogram):
            family(name, "histogram", help_, hist_samples(h, {}))

        def hist_by_model(name: str, help_: str, table: dict[str, _Histogram]):
            family(name, "histogram", help_,
                   [s for m, h in sorted(table.items()) for s in hist_samples(h, {"model": m})])

        with self._lock:
            family("multilora_requests_total", "counter", "Requests accepted, by served model (base or adapter).",
                   [("", {"model": m}, v) for m, v in sorted(self.requests.items())])
            family("multilora_requests_finished_total", "counter", "Requests finished, by model and finish reason.",
                   [("", {"model": m, "finish_reason": r}, v) for (m, r), v in sorted(self.finished.items())])
            family("multilora_requests_rejected_total", "counter", "Requests refused before reaching the engine.",
                   [("", {"reason": r}, v) for r, v in sorted(self.rejected.items())])
            family("multilora_prompt_tokens_total", "counter", "Prompt tokens of accepted requests, by model.",
                   [("", {"model": m}, v) for m, v in sorted(self.prompt_tokens.items())])
            family("multilora_generation_tokens_total", "counter", "Generated tokens, by model.",
                   [("", {"model": m}, v) for m, v in sorted(self.generation_tokens.items())])
            gauges = [
                ("multilora_num_requests_waiting", "Requests queued for a place in the batch."),
                ("multilora_num_requests_running", "Requests in the running batch."),
                ("multilora_kv_pages_used", "KV cache pages in use."),
                ("multilora_kv_pages_total", "KV cache pages that requests can use."),
                ("multilora_kv_cache_usage_ratio", "Fraction of KV cache pages in use."),
                ("multilora_loaded_adapters", "LoRA adapters registered."),
                ("multilora_lora_loads_in_flight", "Adapter host copies being read in the background."),
                ("multilora_lora_resident_adapters", "Adapters resident in the device pool."),
                ("multilora_lora_pool_rows_used", "Rank rows of the device pool held by resident adapters "
                                                  "(each holds as many as its rank)."),
                ("multilora_lora_pool_rows_total", "Rank rows of the device pool for adapters."),
            ]
            for name, help_ in gauges:
                family(name, "gauge", help_, [("", {}, self.gauges.get(name, 0))])
            for key, help_ in (("slot_hits", "Adapter uses found in a device slot."),
                               ("slot_misses", "Adapter uses that had to be written to a device slot."),
                               ("slot_evictions", "Adapters evicted from a device slot."),
                               ("host_hits", "Slot writes served from the host copy."),
                               ("host_misses", "Adapter reads a request waited for: no host copy yet, or no more."),
                               ("host_evictions", "Host copies evicted (max_loaded_loras, lora_host_memory_gb)."),
                               ("loads", "Adapter folders read in the background (first use, or after a host eviction)."),
                               ("load_failures", "Background adapter reads that failed (their requests got an error).")):
                family(f"multilora_lora_{key}_total", "counter", help_,
                       [("", {}, self.adapter_stats.get(key, 0))])
            sched = self.scheduler_stats
            family("multilora_prefix_cache_queries_total", "counter",
                   "Prompt tokens looked up in the prefix cache at admission.",
                   [("", {}, sched.get("prefix_queried_tokens", 0))])
            family("multilora_prefix_cache_hits_total", "counter",
                   "Prompt tokens found in the prefix cache (their K/V not recomputed).",
                   [("", {}, sched.get("prefix_hit_tokens", 0))])
            self._render_gateway(family)
            hist("multilora_time_to_first_token_seconds", "Time from arrival to the first token.", self.ttft)
            hist("multilora_inter_token_latency_seconds", "Time between a request's successive tokens.",
                 self.itl)
            hist_by_model("multilora_model_time_to_first_token_seconds",
                          "Time from arrival to the first token, by served model (base or adapter).",
                          self.ttft_by_model)
            hist_by_model("multilora_model_inter_token_latency_seconds",
                          "Time between a request's successive tokens, by served model.", self.itl_by_model)
            hist("multilora_e2e_request_latency_seconds", "Time from arrival to the end of a request.",
                 self.e2e)
        return "\n".join(out) + "\n"

    def _render_gateway(self, family) -> None:
        """vLLM's names for what gateways route by (see the module docstring); under the lock."""
        g = self.gauges
        common = {"engine": "0", "model_name": self.base_name}
        family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
               [("", common, g.get("multilora_num_requests_running", 0))])
        family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               [("", common, g.get("multilora_num_requests_waiting", 0))])
        usage = g.get("multilora_kv_cache_usage_ratio", 0.0)
        family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
               [("", common, usage)])
        family("vllm:gpu_cache_usage_perc", "gauge",
               "KV-cache usage. 1 means 100 percent usage (the older name of vllm:kv_cache_usage_perc).",
               [("", common, usage)])
        infos = [i for i in (self.lora_info_busy, self.lora_info) if i is not None]
        if infos and infos[0] is infos[-1]:
            infos = infos[:1]
        family("vllm:lora_requests_info", "gauge", "Running stats on lora requests.",
               [("", {"max_lora": str(i.max_lora), "running_lora_adapters": ",".join(i.running),
                      "waiting_lora_adapters": ",".join(i.waiting), "engine": "0"}, i.time)
                for i in infos])
        spec = self.spec_stats
        if spec is not None:  # vLLM's speculative decoding counters (its prometheus_client adds _total)
            for key, help_ in (("num_drafts", "Number of spec decoding drafts."),
                               ("num_draft_tokens", "Number of draft tokens."),
                               ("num_accepted_tokens", "Number of accepted tokens.")):
                family(f"vllm:spec_decode_{key}", "counter", help_, [("_total", common, spec.get(key, 0))])
            family("vllm:spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted tokens per draft position.",
                   [("_total", {**common, "position": str(j)}, v)
                    for j, v in enumerate(spec.get("accepted_per_pos", ()))])


class LoraInfo:
    """One state of vllm:lora_requests_info: the adapters with running and with waiting requests
    (first-seen order), the batch's adapter capacity, and when this was seen (Unix time)."""

    __slots__ = ("running", "waiting", "max_lora", "time")

    def __init__(self, running: Iterable[str], waiting: Iterable[str], max_lora: int,
                 at: Optional[float] = None):
        self.running = tuple(dict.fromkeys(running))
        self.waiting = tuple(dict.fromkeys(waiting))
        self.max_lora = int(max_lora)
        self.time = time.time() if at is None else float(at)
