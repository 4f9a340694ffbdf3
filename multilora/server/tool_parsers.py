"""Tool calls in a model's output (`--tool-call-parser`, vLLM's names), streamed or not.

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks, as Hermes
  and the Qwen2.5/Qwen3 templates write them (and multilora's fallback for templates without a
  tool format); the text around the blocks is the message's content.
- `llama3_json`: Llama 3.1's JSON form, `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), several separated by `;`, when the output opens with one.

    stream = ToolCallStream("hermes")
    for text in deltas:
        events = stream.feed(text)       # Content / CallBegin / CallArgs / CallEnd, in order
    events = stream.finish()
    content, calls = parse_tool_calls("hermes", whole_text)

A call's name goes out as soon as it is read, then its arguments as they arrive (the raw JSON
text of the object); its end says whether the whole call was well formed (the block parses as
JSON with a string name and an object of arguments). parse_tool_calls gives exactly the calls
and content the stream gives for a whole text, except that a malformed call is kept as content
text (a stream may already have sent part of it, as vLLM's do). Whitespace between calls and
text is dropped. A call that repeats an earlier one of the same output word for word ends the
output (`over`): it is dropped with all that follows, and none of its events goes out (a
call's events are held back while its text is the start of an earlier call's). Small models
given room for several calls tend to repeat one until max_tokens. With max_calls, the output is
over once that many calls are read (parallel_tool_calls false: one).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Optional, Union

from multilora.server.reasoning import partial_suffix

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# a call object's head: its name, then where its arguments' value begins
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class Content:
    text: str


@dataclasses.dataclass
class CallBegin:
    index: int
    id: str
    name: str


@dataclasses.dataclass
class CallArgs:
    index: int
    text: str


@dataclasses.dataclass
class CallEnd:
    index: Optional[int]   # None: the call never began (its name was never read)
    ok: bool
    raw: str   # the call's whole text (markers included), for a malformed call kept as content


Event = Union[Content, CallBegin, CallArgs, CallEnd]


@dataclasses.dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str   # JSON text of an object


class _JsonEnd:
    """Finds where one JSON object or array ends, fed piece by piece (strings and escapes
    followed); `consumed(text)` says how much of text belongs to the value."""

    def __init__(self):
        self.depth, self.in_str, self.esc, self.done, self.started = 0, False, False, False, False

    def consumed(self, text: str) -> int:
        for i, c in enumerate(text):
            if self.done:
                return i
            if not self.started:
                if c.isspace():
                    continue
                self.started = True
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
            elif self.depth == 0:  # a scalar where an object belongs: not streamed
                self.done = True
                return i
        return len(text)


def _check_call(body: str) -> Optional[tuple[str, dict]]:
    """(name, arguments) of a call object's text, or None when it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], args


class _Call:
    """One call being read: its text so far, its name once known, its arguments' extent."""

    def __init__(self, take_index):
        self._take_index = take_index  # the stream's next call index, taken when the call begins
        self.index: Optional[int] = None
        self.id, self.text, self.name = call_id(), "", ""
        self.begun = False         # CallBegin sent
        self.outer = _JsonEnd()    # the call object's own end (llama3_json)
        self.args_at = -1          # where the arguments' value starts in text
        self.args_sent = 0         # characters of text sent as arguments (from args_at)
        self.scan = _JsonEnd()
        self.streamed = True       # arguments streamed from the raw text (else sent whole at the end)

    def advance(self) -> list[Event]:
        out: list[Event] = []
        if not self.begun:
            m = _HEAD.match(self.text)
            if m is None:
                return out
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                return out
            self.begun, self.args_at, self.index, self.name = True, m.end(), self._take_index(), name
            out.append(CallBegin(self.index, self.id, name))
        if self.streamed and not self.scan.done:
            rest = self.text[self.args_at + self.args_sent:]
            n = self.scan.consumed(rest)
            if self.args_sent == 0 and not self.scan.started:
                return out
            piece = rest[:n]
            if self.args_sent == 0:
                piece = piece.lstrip()
                self.args_at += n - len(piece)
                n = len(piece)
                if piece and piece[0] not in "{[":
                    self.streamed = False  # not an object: sent whole once the call is read
                    return out
            if piece:
                out.append(CallArgs(self.index, piece))
            self.args_sent += n
        return out

    def end(self, raw: str) -> list[Event]:
        """The call's text is whole: finish it (CallBegin and the arguments first if need be)."""
        out = self.advance()
        checked = _check_call(self.text.strip())
        ok = checked is not None
        if ok and self.begun and self.streamed:
            sent = self.text[self.args_at:self.args_at + self.args_sent]
            ok = self.scan.done and _same_json(sent, checked[1]) and self.name == checked[0]
        elif ok and self.begun:  # name sent, arguments not streamable: all of them now
            out.append(CallArgs(self.index, json.dumps(checked[1], ensure_ascii=False)))
        elif ok:
            self.begun, self.index = True, self._take_index()
            out.append(CallBegin(self.index, self.id, checked[0]))
            out.append(CallArgs(self.index, json.dumps(checked[1], ensure_ascii=False)))
        out.append(CallEnd(self.index, ok, raw))
        return out


def _same_json(text: str, value) -> bool:
    try:
        return json.loads(text) == value
    except ValueError:
        return False


class ToolCallStream:
    """The incremental reader of one choice's output (see the module's docstring)."""

    def __init__(self, parser: str, max_calls: Optional[int] = None):
        if parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool call parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {parser!r}")
        self.parser, self.max_calls = parser, max_calls
        self._buf = ""            # text not yet placed
        self._state = "text" if parser == "hermes" else "open"
        self._call: Optional[_Call] = None
        self._calls = 0
        self._pending_ws = ""     # content's trailing whitespace: dropped if a call follows
        self._skip_ws = False     # drop the whitespace after a call
        self._done: list[str] = []   # the well-formed calls' texts so far
        self._held: list[Event] = []  # the current call's events while it repeats an earlier call's text
        self.over = False         # a call repeated an earlier one, or max_calls were read: the rest is ignored

    # ---- content, with the whitespace around calls dropped --------------------------------------
    def _content(self, text: str, out: list[Event]) -> None:
        if self._skip_ws:
            text = text.lstrip()
            if not text:
                return
            self._skip_ws = False
        full = self._pending_ws + text
        body = full.rstrip()
        self._pending_ws = full[len(body):]
        if body:
            out.append(Content(body))

    def _take_index(self) -> int:
        self._calls += 1
        return self._calls - 1

    def _start_call(self) -> None:
        self._call = _Call(self._take_index)
        self._call.lead_ws, self._pending_ws = self._pending_ws, ""

    def _advance_call(self, out: list[Event]) -> None:
        """The current call's new events, held back while its text is the start of an earlier
        call's (a small model given several calls tends to repeat one until max_tokens)."""
        self._held += self._call.advance()
        text = self._call.text.strip()
        if not any(done.startswith(text) for done in self._done):
            out.extend(self._held)
            self._held = []

    def _end_call(self, raw: str, out: list[Event]) -> None:
        events = self._held + self._call.end(raw)
        self._held = []
        last = events[-1]
        text = self._call.text.strip()
        if last.ok and text in self._done:  # a repeat: dropped, and the output ends here
            self.over, self._buf, self._call = True, "", None
            return
        if last.ok:
            self._done.append(text)
        else:  # kept as text (by parse_tool_calls): with the whitespace around it
            last.raw = self._call.lead_ws + last.raw
        out.extend(events)
        self._call, self._skip_ws = None, last.ok
        if self.max_calls is not None and len(self._done) >= self.max_calls:
            self.over, self._buf = True, ""

    # ---- the two syntaxes -----------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        if self.over:
            return []
        self._buf += text
        out: list[Event] = []
        if self.parser == "hermes":
            self._hermes(out, final=False)
        else:
            self._llama(out, final=False)
        return out

    def finish(self) -> list[Event]:
        if self.over:
            return []
        out: list[Event] = []
        if self.parser == "hermes":
            self._hermes(out, final=True)
        else:
            self._llama(out, final=True)
        if self._pending_ws:
            out.append(Content(self._pending_ws))
            self._pending_ws = ""
        return out

    def _hermes(self, out: list[Event], final: bool) -> None:
        while True:
            if self._call is None:
                at = self._buf.find(HERMES_START)
                if at < 0:
                    keep = 0 if final else partial_suffix(self._buf, HERMES_START)
                    self._content(self._buf[:len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self._content(self._buf[:at], out)
                self._buf = self._buf[at + len(HERMES_START):]
                self._start_call()
            end = self._buf.find(HERMES_END)
            if end < 0:
                keep = 0 if final else partial_suffix(self._buf, HERMES_END)
                self._call.text += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                if not final:
                    self._advance_call(out)
                    return
                self._end_call(HERMES_START + self._call.text, out)  # unterminated at the end
                return
            self._call.text += self._buf[:end]
            self._buf = self._buf[end + len(HERMES_END):]
            self._end_call(HERMES_START + self._call.text + HERMES_END, out)

    def _llama(self, out: list[Event], final: bool) -> None:
        while True:
            if self._state == "text":
                self._content(self._buf, out)
                self._buf = ""
                return
            if self._state in ("open", "between"):  # a call may start here (after ws, a tag, a ';')
                lead = self._buf.lstrip()
                if self._state == "open" and lead.startswith(PYTHON_TAG):
                    lead = lead[len(PYTHON_TAG):].lstrip()
                if self._state == "between" and lead.startswith(";"):
                    lead = lead[1:].lstrip()
                if lead.startswith("{"):
                    self._buf = lead
                    self._start_call()
                    self._state = "call"
                elif not final and (lead == "" or PYTHON_TAG.startswith(lead) or lead == ";"):
                    return
                else:
                    self._state = "text"
                    continue
            scan = self._call.outer
            n = scan.consumed(self._buf)
            self._call.text += self._buf[:n]
            self._buf = self._buf[n:]
            if not scan.done and not final:
                self._advance_call(out)
                return
            self._end_call(self._call.text, out)
            self._state = "between"


def collect(events: list[Event]) -> tuple[str, list[ParsedCall]]:
    """The content and the well-formed calls the events make (a malformed call as content)."""
    content: list[str] = []
    calls: dict[int, ParsedCall] = {}
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, CallBegin):
            calls[e.index] = ParsedCall(e.id, e.name, "")
        elif isinstance(e, CallArgs):
            calls[e.index].arguments += e.text
        elif not e.ok:
            if e.index is not None:
                calls.pop(e.index, None)
            content.append(e.raw)
    return "".join(content), list(calls.values())


def parse_tool_calls(parser: str, text: str) -> tuple[Optional[str], list[ParsedCall]]:
    """A whole output's content (None when it holds calls and nothing else) and its calls."""
    stream = ToolCallStream(parser)
    content, calls = collect(stream.feed(text) + stream.finish())
    return (content or None) if calls else content, calls
