"""Tokenizer (Hugging Face tokenizer.json through the `tokenizers` library), incremental
detokenization, and the chat template from tokenizer_config.json (rendered with jinja2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


class Tokenizer:
    def __init__(self, folder: Path):
        from tokenizers import Tokenizer as HFTokenizer
        self._tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: Optional[str] = self.config.get("chat_template")
        tmpl_file = folder / "chat_template.jinja"
        if self.chat_template is None and tmpl_file.is_file():
            self.chat_template = tmpl_file.read_text()
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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise jinja2.exceptions.TemplateError(msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template writes any BOS itself; don't let the post-processor add a second one.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


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
