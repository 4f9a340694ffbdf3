"""Structured output: a request's constraint (a JSON schema, any JSON object, a regex, a choice
among strings, a Lark grammar) compiled by llguidance into a matcher that, step by step, says
which tokens may come next.

    grammars = Grammars(tokenizer.to_json, vocab_size, eos_token_ids)
    grammars.check(StructuredOutput("json", schema_text))   # ValueError naming the problem
    matcher = grammars.matcher(spec)                         # one per request
    grammars.fill([(matcher, row)], bitmask_QW)              # int32 words, bit t of row: token t allowed
    matcher.consume_token(token)                             # after sampling

The masks are built on the host while the step's forward runs on the device (the runner
dispatches the forward first), one thread per core through llguidance's executor; the runner
applies them on the device for only the rows that carry a constraint. Plain Python and numpy:
no jax here. Legend: Q rows, W = ceil(V / 32) mask words, V vocab.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from typing import Any, Callable, Sequence

import numpy as np

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CACHED_GRAMMARS = 256  # compiled grammar texts kept, by spec (one schema serves many requests)


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. kind "json": spec is a JSON schema (its JSON text);
    "json_object": any JSON object (spec unused); "regex": a regular expression; "choice": a
    JSON list of the allowed strings; "grammar": a Lark grammar (llguidance's dialect)."""

    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured output spec must be a string, got {type(self.spec).__name__}")

    @classmethod
    def json_schema(cls, schema: Any) -> "StructuredOutput":
        """From a schema given as a dict (or bool) or as its JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json", json.dumps(schema))  # key order kept: properties come out in it

    @classmethod
    def choice(cls, options: Sequence[str]) -> "StructuredOutput":
        if (not isinstance(options, (list, tuple)) or not options
                or not all(isinstance(o, str) and o for o in options)):
            raise ValueError("a choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(options)))

    def grammar_text(self) -> str:
        """llguidance's grammar for this constraint (not yet checked)."""
        from llguidance import LLMatcher
        if self.kind == "json":
            # compact JSON: a small model given free whitespace tends to spend its tokens on it
            return LLMatcher.grammar_from_json_schema(self.spec, defaults={"whitespace_flexible": False})
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"},
                                                      defaults={"whitespace_flexible": False})
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            alternatives = " | ".join(json.dumps(o) for o in json.loads(self.spec))
            return LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return LLMatcher.grammar_from_lark(self.spec)

    @property
    def what(self) -> str:
        return {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
                "choice": "choice", "grammar": "grammar"}[self.kind]


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class Grammars:
    """The engine's grammar compiler: one llguidance tokenizer (built on first use, ~1 s), the
    grammars compiled so far (by spec), and a thread pool for the masks. Thread-safe: the server
    checks specs on its own threads while the engine thread builds matchers."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer_json = tokenizer_json  # tokenizer.json's text, asked for on first use
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)  # a complete grammar allows any of them
        self._lock = threading.Lock()
        self._tok = None
        self._executor = None
        self._compiled: OrderedDict[StructuredOutput, str] = OrderedDict()

    def _tokenizer(self):
        with self._lock:
            if self._tok is None:
                import llguidance
                self._tok = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                                   eos_token=self.eos_token_ids or None)
                self._executor = llguidance.LLExecutor()
            return self._tok

    def check(self, spec: StructuredOutput) -> str:
        """The compiled grammar of spec; ValueError saying what is wrong with it."""
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
        from llguidance import LLMatcher
        tok = self._tokenizer()
        try:
            text = spec.grammar_text()
        except (ValueError, TypeError) as e:
            raise ValueError(f"the {spec.what} cannot be compiled: {e}") from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(text, tok)
        if is_error:
            raise ValueError(f"the {spec.what} cannot be compiled: {messages[0].strip()}")
        with self._lock:
            self._compiled[spec] = text
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return text

    def matcher(self, spec: StructuredOutput):
        """A fresh matcher at the start of spec's grammar (ValueError if spec does not compile)."""
        from llguidance import LLMatcher
        m = LLMatcher(self._tokenizer(), self.check(spec), log_level=0)
        if m.is_error():
            raise ValueError(f"the {spec.what} cannot be compiled: {m.get_error()}")
        return m

    def fill(self, matchers_rows: list[tuple], bitmask_QW: np.ndarray) -> None:
        """Write each matcher's allowed next tokens into its row of bitmask_QW (int32 words;
        rows not named are left as they are). An entry (matcher, row, draft) also fills rows
        row + 1 .. row + len(draft), each after the drafts before it (speculative decoding;
        the matcher is left as it was)."""
        from llguidance.numpy import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens
        self._tokenizer()
        drafted = [(e[0], e[1], list(e[2])) for e in matchers_rows if len(e) > 2 and len(e[2])]
        plain = [(e[0], e[1]) for e in matchers_rows if not (len(e) > 2 and len(e[2]))]
        if drafted:  # (llguidance refuses an empty draft there)
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bitmask_QW)
        if plain:
            fill_next_token_bitmask_par(self._executor, plain, bitmask_QW)

    @staticmethod
    def valid_prefix(matcher, draft: Sequence[int]) -> int:
        """How many of draft's tokens the grammar accepts in a row from the matcher's state."""
        return int(matcher.validate_tokens(list(draft))) if draft else 0


def allow_all(rows: int, vocab_size: int) -> np.ndarray:
    """A bitmask that allows every token: the rows without a constraint."""
    return np.full((rows, mask_words(vocab_size)), -1, np.int32)
