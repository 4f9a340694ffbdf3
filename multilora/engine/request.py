"""Requests, their sampling parameters and their state: one object per request carries all of it
(scheduling, pages and prefix keys, outputs, detokenization and what was already reported).
Plain Python, no jax."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional, Sequence

from multilora.engine.structured import StructuredOutput

# The prefix-cache chain of base-model requests starts from this (adapters' from their contents).
BASE_MODEL_HASH = b"multilora:base-model"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What to generate. temperature 0 is greedy; top_k <= 0 and top_p == 1 switch those off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: Optional[int] = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None  # vLLM's: each prompt token's logprob and this many top ones (echo)
    presence_penalty: float = 0.0       # OpenAI's: minus this once for every token already output
    frequency_penalty: float = 0.0      # OpenAI's: minus this per time a token was output
    repetition_penalty: float = 1.0     # vLLM's / transformers': over prompt and output tokens
    logit_bias: Sequence[tuple[int, float]] = ()  # (token id, added to its logit), OpenAI's
    min_tokens: int = 0                 # vLLM's: no EOS or stop token before this many tokens
    structured: Optional[StructuredOutput] = None  # what the output must match (a JSON schema, ...)

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        if isinstance(self.structured, dict):  # from dataclasses.asdict (several processes)
            object.__setattr__(self, "structured", StructuredOutput(**self.structured))
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < -1):
            raise ValueError(f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not (0 <= value <= 20)):
                raise ValueError(f"{name} must be an integer in [0, 20], got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not (0.0 < self.repetition_penalty <= 10.0):
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        if len(self.logit_bias) > 300:
            raise ValueError(f"logit_bias may hold at most 300 tokens, got {len(self.logit_bias)}")
        for tok, bias in self.logit_bias:
            if tok < 0:
                raise ValueError(f"logit_bias: token id {tok} is negative")
            if not (-100.0 <= bias <= 100.0):
                raise ValueError(f"logit_bias: the bias of token {tok} must be in [-100, 100], got {bias!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        if not isinstance(self.min_tokens, int) or not (0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")

    @property
    def processes_logits(self) -> bool:
        """Does this request need the logits processor (penalties, bias, min_tokens)?"""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


PENDING_TOKEN = -1  # an output token a dispatched step has sampled but the host has not read yet


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int                       # monotonic admission order: first come, first served
    adapter: Optional[str] = None      # adapter name, None for the base model
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list = dataclasses.field(default_factory=list)
    prompt_logprobs: list = dataclasses.field(default_factory=list)  # per prompt token (the first: None)
    num_computed_tokens: int = 0       # tokens whose K/V are in the cache
    block_table: list[int] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None  # "stop", "length", "abort"
    stop_reason: Optional[object] = None
    num_preemptions: int = 0
    skipped_steps: int = 0             # times a later request was admitted ahead of it
    max_tokens: int = 0                # params.max_tokens, bounded by the context
    sample_seed: int = 0               # params.seed, or one derived from the engine seed and id
    # prefix cache
    lora_hash: bytes = BASE_MODEL_HASH  # the adapter's content hash: the root of its page keys
    lora_version: int = 0               # the adapter name's load count when it was added (0: base)
    page_keys: list = dataclasses.field(default_factory=list)  # keys of its first full pages
    num_cached_tokens: int = 0         # prompt tokens found in the prefix cache at admission
    # output side: detokenized text and what has been reported so far
    detok: Any = None
    text: str = ""
    sent_tokens: int = 0
    sent_text: int = 0
    sent_logprobs: int = 0
    error: Optional[str] = None
    # n > 1: a sibling that waits for this request's prompt to be prefilled, then takes its
    # pages from the prefix cache (one prefill for all choices)
    follows: Optional["Request"] = None
    # structured output: the llguidance matcher of params.structured, fed every output token
    matcher: Any = None
    # async scheduling: the last output token is PENDING_TOKEN, sampled by a step still on the
    # device (the next step may already compute it: it is fed there on the device)
    awaiting: bool = False

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than one known token lacks K/V: a new, chunked or preempted request. With exactly
        one (the last sampled token, or a one-token prompt) a decode step serves it."""
        return self.num_uncomputed > 1

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


def stop_after_token(req: Request, eos_token_ids) -> Optional[tuple[str, Any]]:
    """After a token is appended: (finish_reason, stop_reason) if the request ends here, else
    None. The text is decoded first and cut before a stop string that it now holds."""
    p = req.params
    token = req.output_token_ids[-1]
    if req.detok is not None:
        req.text = req.detok.decode(req.output_token_ids)
    if len(req.output_token_ids) < p.min_tokens:  # min_tokens: only the length may end it
        return ("length", None) if len(req.output_token_ids) >= req.max_tokens else None
    if not p.ignore_eos and token in eos_token_ids:
        return "stop", None
    if token in p.stop_token_ids:
        return "stop", token
    if req.matcher is not None and req.matcher.is_stopped():  # the grammar is complete
        return "stop", None
    if p.stop and req.detok is not None:
        for s in p.stop:
            k = req.text.find(s, max(0, req.sent_text - len(s)))
            if k >= 0:
                req.text = req.text[:k]
                return "stop", s
    if len(req.output_token_ids) >= req.max_tokens:
        return "length", None
    return None
