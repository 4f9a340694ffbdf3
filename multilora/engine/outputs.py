"""What the engine reports: a finished request's RequestOutput, the StreamDelta a step added to a
request, and their Logprobs. Plain dataclasses, no jax."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: Optional[str] = None   # "stop" | "length" | "abort" | "error"
    stop_reason: Optional[object] = None
    lora: Optional[str] = None
    logprobs: Optional[list[Logprob]] = None
    error: Optional[str] = None
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache
    prompt_logprobs: Optional[list[Optional[Logprob]]] = None  # params.prompt_logprobs: one per prompt token
    lora_version: Optional[str] = None    # which weights answered (adapter_api.version_tag); None: base


@dataclasses.dataclass
class StreamDelta:
    """What one step added to a request: for streaming."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: Optional[str] = None
    logprobs: Optional[list[Logprob]] = None
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache
    prompt_logprobs: Optional[list[Optional[Logprob]]] = None  # in the first delta, when asked
    lora_version: Optional[str] = None    # which weights answer (adapter_api.version_tag); None: base


class PromptTooLongError(ValueError):
    pass


def finite_logprob(logprob) -> float:
    """A logprob for JSON: -inf (a masked or banned token) as -9999.0, as vLLM reports it."""
    return max(float(logprob), -9999.0)


def logprob_of(token_id: int, chosen, top_ids_K, top_vals_K, n: int) -> Logprob:
    """One token's Logprob from the device's (chosen, top ids, top logprobs), n alternatives."""
    return Logprob(token_id, finite_logprob(chosen),
                   [(t, finite_logprob(v)) for t, v in zip(top_ids_K[:n].tolist(), top_vals_K[:n].tolist())])


def prompt_next_tokens(c) -> Optional[list[int]]:
    """For a chunk of a request that wants prompt logprobs and still covers prompt tokens:
    the token after each of its tokens (0 past the prompt: not kept)."""
    req = c.request
    n_prompt = len(req.prompt_token_ids)
    if req.params.prompt_logprobs is None or c.start >= n_prompt - 1:
        return None
    ids = req.prompt_token_ids
    return [ids[p + 1] if p + 1 < n_prompt else 0 for p in range(c.start, c.start + c.num_tokens)]

def keep_prompt_logprobs(c, scored) -> None:
    req = c.request
    chosen, top_ids, top_vals = scored
    k = req.params.prompt_logprobs
    n_prompt = len(req.prompt_token_ids)
    for j, p in enumerate(range(c.start, min(c.start + c.num_tokens, n_prompt - 1))):
        req.prompt_logprobs[p + 1] = logprob_of(req.prompt_token_ids[p + 1], chosen[j], top_ids[j], top_vals[j], k)
