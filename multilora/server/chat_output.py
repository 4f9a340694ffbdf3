"""A chat choice's text turned into OpenAI's message fields: reasoning split off first
(multilora.server.reasoning), then tool calls read out of the rest (multilora.server.tool_parsers),
for a whole response or delta by delta for a stream.

    out = ChatOutput(reasoning_parser, tool_parser)
    deltas = out.feed(text)                  # DeltaMessages for this piece (maybe none)
    if out.over: ...                         # a repeated call, or one too many: stop generating
    deltas += out.finish()
    message, finish_reason = out.result(engine_finish_reason)    # the whole message (not streamed)

A choice that called tools finishes with "tool_calls" where the engine said "stop". A whole
message keeps a malformed call as text, where a stream may have sent part of it already.
"""

from __future__ import annotations

from typing import Optional

from multilora.server import protocol as P
from multilora.server.reasoning import ReasoningSplitter
from multilora.server.tool_parsers import CallArgs, CallBegin, CallEnd, Content, ToolCallStream, collect


class ChatOutput:
    def __init__(self, reasoning_parser: Optional[str], tool_parser: Optional[str],
                 max_calls: Optional[int] = None):
        self._split = ReasoningSplitter(reasoning_parser) if reasoning_parser else None
        self._tools = ToolCallStream(tool_parser, max_calls) if tool_parser else None
        self.called = False   # a call began (the stream's finish_reason becomes "tool_calls")
        self._reasoning: list[str] = []   # what the whole message gathers
        self._content: list[str] = []
        self._events: list = []

    @property
    def active(self) -> bool:
        return self._split is not None or self._tools is not None

    @property
    def over(self) -> bool:
        """The output has ended early (a repeated call, or max_calls read): stop generating it."""
        return self._tools is not None and self._tools.over

    def _deltas(self, reasoning: str, content: str, final: bool) -> list[P.DeltaMessage]:
        out: list[P.DeltaMessage] = []
        if reasoning:
            self._reasoning.append(reasoning)
            out.append(P.DeltaMessage(reasoning_content=reasoning))
        if self._tools is None:
            if content:
                self._content.append(content)
                out.append(P.DeltaMessage(content=content))
            return out
        events = self._tools.feed(content) if content else []
        if final:
            events += self._tools.finish()
        self._events += events
        for e in events:
            if isinstance(e, Content):
                out.append(P.DeltaMessage(content=e.text))
            elif isinstance(e, CallBegin):
                self.called = True
                out.append(P.DeltaMessage(tool_calls=[P.DeltaToolCall(
                    index=e.index, id=e.id, type="function",
                    function=P.DeltaFunctionCall(name=e.name, arguments=""))]))
            elif isinstance(e, CallArgs):
                out.append(P.DeltaMessage(tool_calls=[P.DeltaToolCall(
                    index=e.index, function=P.DeltaFunctionCall(arguments=e.text))]))
            elif isinstance(e, CallEnd) and e.index is None:  # never began: it was text after all
                out.append(P.DeltaMessage(content=e.raw))
        return _merged(out)

    def feed(self, text: str) -> list[P.DeltaMessage]:
        reasoning, content = self._split.feed(text) if self._split else ("", text)
        return self._deltas(reasoning, content, final=False)

    def finish(self) -> list[P.DeltaMessage]:
        reasoning, content = self._split.finish() if self._split else ("", "")
        return self._deltas(reasoning, content, final=True)

    def result(self, finish_reason: Optional[str]) -> tuple[P.ChatResponseMessage, Optional[str]]:
        """The whole message, once fed and finished, and its finish_reason."""
        content, calls = "".join(self._content), []
        if self._tools is not None:
            content, parsed = collect(self._events)
            calls = [P.ToolCall(id=c.id, function=P.FunctionCall(name=c.name, arguments=c.arguments))
                     for c in parsed]
            if calls:
                content = content or None
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        msg = P.ChatResponseMessage(content=content, tool_calls=calls or None,
                                    reasoning_content="".join(self._reasoning) or None)
        return msg, finish_reason

    def message(self, text: str, finish_reason: Optional[str]) -> tuple[P.ChatResponseMessage, Optional[str]]:
        """A whole choice's message and finish_reason, from its whole text."""
        self.feed(text)
        self.finish()
        return self.result(finish_reason)

    def finish_reason(self, engine_reason: Optional[str]) -> Optional[str]:
        return "tool_calls" if self.called and engine_reason == "stop" else engine_reason


def _merged(deltas: list[P.DeltaMessage]) -> list[P.DeltaMessage]:
    """Neighbouring pieces of one kind in one delta (fewer chunks on the wire); a call's first
    delta (id and name, arguments "") stays alone, as OpenAI sends it."""
    out: list[P.DeltaMessage] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is not None and d.content is not None and last.content is not None \
                and last.tool_calls is None and d.tool_calls is None:
            last.content += d.content
        elif last is not None and d.reasoning_content is not None and last.reasoning_content is not None:
            last.reasoning_content += d.reasoning_content
        elif (last is not None and d.tool_calls and last.tool_calls and d.tool_calls[0].id is None
              and last.tool_calls[-1].id is None and last.tool_calls[-1].index == d.tool_calls[0].index):
            last.tool_calls[-1].function.arguments += d.tool_calls[0].function.arguments
        else:
            out.append(d)
    return out
