"""Reasoning output (`--reasoning-parser`, as in vLLM and SGLang): the `<think>...</think>` part of
a completion goes to `reasoning_content`, the rest to `content`, streamed or not.

    split = ReasoningSplitter("qwen3")
    for text in deltas:
        reasoning, content = split.feed(text)     # what each field gains
    reasoning, content = split.finish()

`deepseek_r1`: the output is reasoning up to `</think>` (the template may have opened the block
in the prompt, so a leading `<think>` is optional); without `</think>` all of it is reasoning.
`qwen3`: reasoning only when the output opens with `<think>` (Qwen3's template closes an empty
block in the prompt when thinking is off); the content is the rest. Whitespace between the block
and the content is dropped. A whole text fed at once splits exactly as its pieces do.
"""

from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that is a proper start of marker (held back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplitter:
    def __init__(self, parser: str):
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {parser!r}")
        self.parser = parser
        self._buf = ""                # text not yet given to either field
        self._state = "start"         # start -> reasoning -> content
        self._strip = False           # drop whitespace before the content's first character

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            if self._state == "start":
                lead = self._buf.lstrip()
                if lead.startswith(START):
                    self._buf, self._state = lead[len(START):], "reasoning"
                elif lead == "" or START.startswith(lead):
                    break  # not yet known
                else:
                    self._state = "reasoning" if self.parser == "deepseek_r1" else "content"
            elif self._state == "reasoning":
                end = self._buf.find(END)
                if end < 0:
                    keep = partial_suffix(self._buf, END)
                    reasoning.append(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                reasoning.append(self._buf[:end])
                self._buf, self._state, self._strip = self._buf[end + len(END):], "content", True
            else:
                if self._strip:
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        break
                    self._strip = False
                content.append(self._buf)
                self._buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output is whole."""
        buf, self._buf = self._buf, ""
        if self._state == "reasoning" or (self._state == "start" and self.parser == "deepseek_r1"):
            return buf, ""
        return "", buf.lstrip() if self._strip else buf
