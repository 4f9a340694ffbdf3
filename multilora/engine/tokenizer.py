"""Tokenizer (Hugging Face tokenizer.json through the `tokenizers` library), incremental
detokenization, and the chat template from tokenizer_config.json or chat_template.jinja
(rendered with jinja2 as transformers renders it: `tools`, `tojson` without HTML escaping,
`strftime_now`). An adapter folder may ship its own template (read_chat_template)."""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np


def read_chat_template(folder) -> Optional[str]:
    """The chat template a folder ships: tokenizer_config.json's `chat_template` (a string, or
    transformers' list of named templates: "default" or the first), else chat_template.jinja."""
    folder = Path(folder)
    cfg_path = folder / "tokenizer_config.json"
    template = None
    if cfg_path.is_file():
        try:
            template = json.loads(cfg_path.read_text()).get("chat_template")
        except (ValueError, OSError, AttributeError):
            template = None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if not isinstance(template, str) or not template:
        tmpl_file = folder / "chat_template.jinja"
        template = tmpl_file.read_text() if tmpl_file.is_file() else None
    return template


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: plain json.dumps (jinja2's own escapes <, > and & for HTML)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compiled(template: str):
    """A template's compiled form and whether it reads `tools` (has a tool format of its own)."""
    import jinja2
    from jinja2 import meta, nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    class Generation(Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens
        for training): the body as it is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", Generation])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    reads_tools = "tools" in meta.find_undeclared_variables(env.parse(template))
    return env.from_string(template), reads_tools


def template_has_tools(template: Optional[str]) -> bool:
    """Whether a chat template renders `tools` itself (its own tool format)."""
    return bool(template) and _compiled(template)[1]


class Tokenizer:
    def __init__(self, folder: Path):
        from tokenizers import Tokenizer as HFTokenizer
        self._tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: Optional[str] = read_chat_template(folder)
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The whole tokenizer as tokenizer.json text (what llguidance builds its own from)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> Optional[str]:
        return self._tok.id_to_token(i)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None, template: Optional[str] = None,
                            **kwargs: Any) -> str:
        """The prompt text; `template` (an adapter's own) in place of the model's; `tools` in
        OpenAI's shape, and any extra kwargs, reach the template as transformers passes them."""
        template = template or self.chat_template
        if not template:
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
        compiled = _compiled(template)[0]
        return compiled.render(**kwargs, messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        # The template writes any BOS itself; don't let the post-processor add a second one.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


def _token_text(tok) -> Optional[str]:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def load_tokenizer(folder) -> Optional[Tokenizer]:
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        return None
    return Tokenizer(folder)


class Detokenizer:
    """Text of a growing list of ids, decoded incrementally: each new token is decoded together
    with a few tokens before it (so byte-level merges and leading-space rules come out as in a
    whole decode) and only the new characters are kept. A token that ends inside a multi-byte
    character waits until the character is complete; the cost per token stays constant."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.text = ""
        self._prefix = 0  # ids[_prefix:_read] are already in text; they give the new ones context
        self._read = 0

    def decode(self, ids) -> str:
        """All text so far for `ids` (the same list, grown since the last call)."""
        if self._read < len(ids):
            seen = self.tokenizer.decode(ids[self._prefix:self._read])
            full = self.tokenizer.decode(ids[self._prefix:])
            if not full.endswith("\ufffd") and len(full) >= len(seen):  # else: a partial character
                self.text += full[len(seen):]
                self._prefix, self._read = self._read, len(ids)
        return self.text


def prompt_token_ids(prompt, tokenizer, vocab_size: int, model_path: str) -> list[int]:
    """A prompt's token ids: a text encoded by the model's tokenizer (ValueError where the model
    has none), or ids given, checked to be integers in the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"model folder {model_path!r} has no tokenizer.json: pass prompts as lists of token ids")
        return tokenizer.encode(prompt)
    ids = list(prompt)
    if any(not isinstance(t, (int, np.integer)) or not (0 <= t < vocab_size) for t in ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    return [int(t) for t in ids]
