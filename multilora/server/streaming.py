"""Server-sent events for streamed completions: the OpenAI chunk streams of /v1/completions and
/v1/chat/completions, merging several prompts' streams, and a response that aborts its requests
whenever it ends (finished, failed, or the client gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional, Sequence

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from multilora.server import protocol as P
from multilora.server.async_engine import RequestStream

if TYPE_CHECKING:
    from multilora.server.chat_output import ChatOutput
    from multilora.server.service import Server as _Server


async def _merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, delta) from several streams as they come."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream):
        try:
            async for d in s:
                q.put_nowait((i, d))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, d = await q.get()
            if d is None:
                remaining -= 1
                continue
            yield i, d
    finally:
        for t in tasks:
            t.cancel()


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(StreamingResponse):
    """A server-sent-event stream that watches for the client leaving whatever the ASGI server's
    spec version, and always aborts its requests when it ends (a no-op for finished ones), even
    when the body generator never started."""

    def __init__(self, body: AsyncIterator[str], streams: Sequence[RequestStream]):
        super().__init__(body, media_type="text/event-stream", headers=_SSE_HEADERS)
        self._streams = streams

    async def __call__(self, scope, receive, send):
        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.create_task(watch())
        streaming = asyncio.create_task(self.stream_response(send))
        try:
            done, _ = await asyncio.wait({watcher, streaming}, return_when=asyncio.FIRST_COMPLETED)
            if streaming in done:
                with contextlib.suppress(OSError):  # the client went away while we wrote
                    streaming.result()
        finally:
            for task in (watcher, streaming):
                task.cancel()
            await asyncio.gather(watcher, streaming, return_exceptions=True)
            for st in self._streams:
                st.abort()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


def _sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


def _error_event(message: str) -> str:
    return _sse(P.error_body(500, message, code="engine_error"))


async def completion_stream(srv: "_Server", streams: list[RequestStream], model: str, rid: str, created: int,
                            include_usage: bool, n: int = 1, echo_texts: Optional[list[str]] = None,
                            score_only: bool = False) -> AsyncIterator[str]:
    """Chunks of every choice as they come, each with its index (prompt-major, n per prompt).
    echo: a choice's first chunk starts with its prompt (and the prompt's logprobs); score_only
    (echo with max_tokens 0): that is all it carries."""
    completion_tokens = 0
    offsets = [0] * len(streams)
    opened = [False] * len(streams)
    try:
        async for i, d in _merge(streams):
            if d.finished and d.finish_reason == "error":
                yield _error_event(f"the request failed: {streams[i].error or 'engine error'}")
                continue
            if score_only:
                d = dataclasses.replace(d, token_ids=[], text="", logprobs=[] if d.logprobs is not None else None,
                                        finish_reason="length" if d.finished else None)
            completion_tokens += len(d.token_ids)
            text, lp = d.text, None
            if echo_texts is not None and not opened[i]:
                opened[i] = True
                text, lp = srv.echoed(echo_texts[i], streams[i].prompt_token_ids, d.prompt_logprobs, d.text,
                                      d.logprobs, d.logprobs is not None)
            elif d.logprobs is not None:
                lp = srv.completion_logprobs(d.logprobs, offsets[i])
            if not (text or d.finished or (lp is not None and lp.tokens)):
                continue
            offsets[i] += len(text)
            chunk = P.CompletionChunk(id=rid, created=created, model=model, choices=[
                P.CompletionChoice(index=i, text=text, logprobs=lp,
                                   finish_reason=d.finish_reason if d.finished else None)],
                system_fingerprint=d.lora_version)
            yield _sse(chunk)
        if include_usage:
            prompt_tokens = sum(len(s.prompt_token_ids) for s in streams[::n])  # once per prompt
            cached = sum(s.num_cached_tokens for s in streams[::n])
            yield _sse(P.CompletionChunk(id=rid, created=created, model=model, choices=[],
                                         usage=P.UsageInfo.of(prompt_tokens, completion_tokens, cached)))
        yield "data: [DONE]\n\n"
    finally:  # the client went away (or we are done): free what is still running
        for s in streams:
            s.abort()


async def chat_stream(srv: "_Server", streams: list[RequestStream], model: str, rid: str, created: int,
                      include_usage: bool, logprobs: bool, n: int = 1,
                      output: Optional[Callable[[], "ChatOutput"]] = None) -> AsyncIterator[str]:
    """Each choice opens with its role delta, then its deltas interleave as they come, each
    with its index (OpenAI's stream with n > 1). output: a choice's reader of reasoning and tool
    calls (multilora.server.chat_output), whose deltas replace the plain text ones."""
    completion_tokens = 0
    outs = [output() for _ in streams] if output is not None else None
    if outs is not None and not outs[0].active:
        outs = None
    ended: set[int] = set()

    def chunk(i: int, delta: P.DeltaMessage, lp=None, finish_reason=None, fingerprint=None) -> str:
        return _sse(P.ChatCompletionChunk(id=rid, created=created, model=model, choices=[
            P.ChatStreamChoice(index=i, delta=delta, logprobs=lp, finish_reason=finish_reason)],
            system_fingerprint=fingerprint))

    try:
        for i in range(len(streams)):
            yield chunk(i, P.DeltaMessage(role="assistant", content=""))
        async for i, d in _merge(streams):
            completion_tokens += len(d.token_ids)
            if d.finished and d.finish_reason == "error":
                yield _error_event(f"the request failed: {streams[i].error or 'engine error'}")
                continue
            if not (d.text or d.finished or d.logprobs):
                continue
            lp = srv.chat_logprobs(d.logprobs) if (logprobs and d.logprobs is not None) else None
            reason = d.finish_reason if d.finished else None
            if outs is None:
                yield chunk(i, P.DeltaMessage(content=d.text if d.text else None), lp, reason, d.lora_version)
                continue
            if i in ended:  # queued before its choice ended early
                continue
            deltas = outs[i].feed(d.text) if d.text else []
            if outs[i].over and not d.finished:  # a repeated call (or one too many): it ends here
                streams[i].abort()
                d = dataclasses.replace(d, finished=True, finish_reason="stop")
                reason = "stop"
            if d.finished:
                ended.add(i)
                deltas += outs[i].finish()
                reason = outs[i].finish_reason(reason)
            if lp is not None and not deltas:  # logprobs of held-back text still go out
                deltas = [P.DeltaMessage()]
            for k, delta in enumerate(deltas):
                yield chunk(i, delta, lp if k == 0 else None, None, d.lora_version)
            if d.finished:
                yield chunk(i, P.DeltaMessage(), None, reason, d.lora_version)
        if include_usage:
            yield _sse(P.ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                             usage=P.UsageInfo.of(len(streams[0].prompt_token_ids),
                                                                  completion_tokens, streams[0].num_cached_tokens)))
        yield "data: [DONE]\n\n"
    finally:
        for s in streams:
            s.abort()
