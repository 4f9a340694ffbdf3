"""What the routes share: the engine behind them (an AsyncEngine), how a request's `model`
resolves to the base model, an adapter (loaded on first use under --lora-root) or a weighted
mix, sampling parameters from the wire fields, submitting and collecting streams, logprobs in
OpenAI's shapes, and the confinement of adapter paths."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Callable, Optional, Sequence

from fastapi import Request

from multilora.engine.build import generation_sampling_defaults
from multilora.engine.request import SamplingParams
from multilora.engine.structured import StructuredOutput
from multilora.engine.tokenizer import read_chat_template
from multilora.adapters.registry import AdapterConflictError, AdapterUnloadingError, UnknownAdapterError
from multilora.server import protocol as P
from multilora.server.async_engine import AsyncEngine, EngineStoppedError, QueueFullError, RequestStream
from multilora.server.errors import APIError, call_engine, err_text
from multilora.server.guided import structured_output
from multilora.server.reasoning import REASONING_PARSERS
from multilora.server.tool_parsers import TOOL_CALL_PARSERS
from multilora.server.tools import ToolPlan, plan_tools, template_messages

log = logging.getLogger("multilora.server")

MAX_ADAPTER_NAME = 256
MAX_CHOICES = 128  # n per prompt (OpenAI's limit)
TOOL_PARSER_CHOICES = ("auto", "none") + TOOL_CALL_PARSERS   # --tool-call-parser
# what the server itself passes a chat template (chat_template_kwargs may not set them)
TEMPLATE_ARGUMENTS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "template"})


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


@dataclasses.dataclass
class Collected:
    """One choice run to its end (a non-streamed response): what the route turns into JSON."""
    text: str
    token_ids: list[int]
    logprobs: list                       # engine Logprobs of the chosen tokens (when asked)
    finish_reason: Optional[str]
    prompt_tokens: int
    cached_tokens: int                   # prompt tokens served from the prefix cache
    prompt_ids: list[int]
    prompt_logprobs: Optional[list]
    echo: Optional[str] = None           # /v1/completions with echo: the prompt's text
    lora_version: Optional[str] = None   # which adapter weights answered (system_fingerprint)

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)


def base_model_names(engine, served_model_names: Optional[Sequence[str]] = None) -> tuple[str, set[str]]:
    """The base model's name in responses and /v1/models, and every name a request may call it by:
    served_model_names (vLLM's --served-model-name: the first is the one shown) where given, else
    the model folder's name and its path. ValueError for an empty or repeated name."""
    if served_model_names is None:
        names = {engine.model_name, str(engine.model_path)}
        with contextlib.suppress(OSError):
            names.add(str(Path(engine.model_path).resolve()))
        return engine.model_name, names
    names = check_served_names(served_model_names, [a["name"] for a in engine.list_lora_adapters()])
    return names[0], set(names)


def check_served_names(served_model_names: Sequence[str], adapter_names: Sequence[str] = ()) -> list[str]:
    """The names as a list, or ValueError for none, an empty or repeated one, or one an adapter has."""
    names = list(served_model_names)
    if not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise ValueError(f"--served-model-name takes one or more non-empty names, got {names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"--served-model-name repeats a name: {names!r}")
    clash = sorted(set(names) & set(adapter_names))
    if clash:
        raise ValueError(f"{clash[0]!r} names both the base model and a LoRA adapter: serve the adapter "
                         "under another name, or the base model under another --served-model-name")
    return names


def check_generation_config(generation_config: str) -> None:
    """ValueError unless --generation-config is auto, vllm or a folder holding generation_config.json."""
    if generation_config not in ("auto", "vllm") and not (Path(generation_config) / "generation_config.json").is_file():
        raise ValueError(f"--generation-config {generation_config!r}: expected auto, vllm or a folder "
                         "holding generation_config.json")


def sampling_defaults(generation_config: str, model_path) -> dict:
    """--generation-config (vLLM's): "auto", the model's generation_config.json sampling values as
    the defaults of a request's unset fields; "vllm", none (OpenAI's defaults); else a folder whose
    generation_config.json gives them (check_generation_config's ValueError otherwise)."""
    check_generation_config(generation_config)
    if generation_config == "vllm":
        return {}
    folder = model_path if generation_config == "auto" else generation_config
    out = generation_sampling_defaults(str(folder))
    if out:
        log.info("default sampling from %s/generation_config.json: %s (a request's own values win; "
                 "--generation-config vllm: OpenAI's defaults)", folder,
                 ", ".join(f"{k}={v}" for k, v in out.items()))
    return out


class Server:
    """The routes' shared state: the engine, its names and the adapter path policy."""

    def __init__(self, aengine: AsyncEngine, lora_root: Optional[str], allow_any_lora_path: bool,
                 tool_call_parser: str = "auto", reasoning_parser: Optional[str] = None,
                 served_model_names: Optional[Sequence[str]] = None, chat_template: Optional[str] = None,
                 generation_config: str = "auto"):
        if tool_call_parser not in TOOL_PARSER_CHOICES:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSER_CHOICES)}, "
                             f"got {tool_call_parser!r}")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {reasoning_parser!r}")
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self._templates: dict[tuple, Optional[str]] = {}  # (adapter folder, version) -> its own template
        self.aengine = aengine
        eng = aengine.engine
        self.engine = eng
        self.base_name, self.base_names = base_model_names(eng, served_model_names)
        self.chat_template_override = chat_template   # --chat-template
        self.sampling_defaults = sampling_defaults(generation_config, eng.model_path)
        aengine.metrics.base_name = self.base_name   # the base model's `model` label
        self.lora_root = Path(lora_root).resolve() if lora_root else None
        self.allow_any_lora_path = allow_any_lora_path
        self._resolving: dict[str, asyncio.Future] = {}   # adapter name -> its first-use load

    # ---- request building ------------------------------------------------------------------
    async def resolve_model(self, name: str) -> Optional[str]:
        """None for the base model, else the adapter name (the engine checks it exists). With
        --lora-root, a name that is not registered yet but names an adapter folder under the
        root is loaded now, on first use (read off the engine thread; concurrent first requests
        share one load)."""
        if not name:
            raise APIError(400, "model is required: the base model's name or a LoRA adapter's", "model")
        if name in self.base_names:
            return None
        if self.lora_root is not None and self.engine.slots is not None \
                and name not in self.engine.registry.entries:
            await self._load_on_first_use(name)
        return name

    async def request_adapter(self, req: P._SamplingFields) -> Optional[str]:
        """The adapter a generation request runs: its `model`, or with the `adapters` extra the
        weighted mix of those adapters (registered once, on the engine thread)."""
        if req.adapters is None:
            return await self.resolve_model(req.model)
        if req.model not in self.base_names and req.model != "mix":
            raise APIError(400, f"with adapters, model names the base model ({self.base_name!r}) or \"mix\", "
                                f"got {req.model!r}", "adapters")
        for part in req.adapters:
            if part not in self.base_names:
                await self.resolve_model(part)  # first-use loads under --lora-root
        try:
            return await call_engine(self.aengine.call(lambda e: e.add_mix(req.adapters)))
        except (UnknownAdapterError, AdapterUnloadingError) as e:
            raise APIError(404, f"adapters: {err_text(e)}", "adapters", "model_not_found")
        except ValueError as e:
            raise APIError(400, str(e), "adapters")

    async def known_model(self, name: str) -> None:
        """resolve_model, and a 404 for a name that is neither the base model nor an adapter
        (the generation routes get it from the engine when they submit)."""
        lora = await self.resolve_model(name)
        if lora is not None and (lora not in self.engine.registry.entries
                                 or self.engine.registry.entries[lora].unloading):
            raise APIError(404, f"the model {name!r} does not exist: it is neither the base model "
                                f"{self.base_name!r} nor a loaded LoRA adapter", "model", "model_not_found")

    async def _load_on_first_use(self, name: str) -> None:
        fut = self._resolving.get(name)
        if fut is None:
            fut = self._resolving[name] = asyncio.ensure_future(self._resolve_from_root(name))
            fut.add_done_callback(lambda _: self._resolving.pop(name, None))
        await asyncio.shield(fut)

    async def _resolve_from_root(self, name: str) -> None:
        if len(name) > MAX_ADAPTER_NAME or any(ord(c) < 32 for c in name):
            return  # not a folder name: the engine reports the unknown model
        candidate = self.lora_root / name
        resolved = candidate.resolve()
        if resolved == self.lora_root or self.lora_root not in resolved.parents:
            raise APIError(404, f"the model {name!r} does not exist: it is neither the base model "
                                f"{self.base_name!r} nor a loaded LoRA adapter, and it does not name a "
                                "folder inside the server's --lora-root", "model", "model_not_found")
        if not (resolved / "adapter_config.json").is_file():
            return  # no such adapter folder: the engine reports the unknown model (404)
        try:
            await self.aengine.load_lora_adapter(name, str(resolved))
        except AdapterConflictError:
            return  # registered meanwhile (another request, or /v1/load_lora_adapter)
        except EngineStoppedError as e:
            raise APIError(503, str(e), code="unavailable")
        except ValueError as e:  # AdapterError: the folder is not a servable adapter
            raise APIError(400, f"the model {name!r} names a folder under --lora-root that is not a "
                                f"servable LoRA adapter: {e}", "model", "invalid_adapter")
        log.info("loaded LoRA adapter %r from %s on first use", name, resolved)

    async def chat_template(self, lora: Optional[str]) -> Optional[str]:
        """The chat template a request renders with: its adapter folder's own (tokenizer_config.json
        or chat_template.jinja beside the weights), else --chat-template's, else the model's."""
        base = self.chat_template_override or (
            self.engine.tokenizer.chat_template if self.engine.tokenizer is not None else None)
        entry = self.engine.registry.entries.get(lora) if lora is not None and self.engine.slots is not None else None
        if entry is None:
            return base
        key = (entry.path, entry.version)  # an in-place load may bring another template
        if key not in self._templates:
            if len(self._templates) > 1024:
                self._templates.clear()
            self._templates[key] = await asyncio.to_thread(read_chat_template, entry.path)
        return self._templates[key] or base

    def tool_plan(self, req: P.ChatCompletionRequest, template: Optional[str]) -> ToolPlan:
        return plan_tools(req, template, self.tool_call_parser, self.reasoning_parser)

    async def chat_ids(self, messages: list, add_generation_prompt: bool, plan: Optional[ToolPlan] = None,
                       template: Optional[str] = None, template_kwargs: Optional[dict] = None) -> list[int]:
        """The chat template over the messages (and the plan's tools; template_kwargs: vLLM's
        chat_template_kwargs, e.g. enable_thinking) -> prompt token ids (400s name what is wrong)."""
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer: use /v1/completions with token ids", "messages")
        if not messages:
            raise APIError(400, "messages must hold at least one message", "messages")
        kwargs = dict(template_kwargs or {})
        taken = sorted(set(kwargs) & TEMPLATE_ARGUMENTS)
        if taken:
            raise APIError(400, f"chat_template_kwargs: {taken[0]!r} is set by the server (it cannot be given "
                                f"here: {', '.join(sorted(TEMPLATE_ARGUMENTS))})", "chat_template_kwargs")
        rendered, tools = template_messages(messages, plan)

        def encode():
            try:
                return tok.encode_chat(rendered, add_generation_prompt, tools=tools, template=template, **kwargs)
            except Exception:
                if plan is None or plan.native or not plan.tools or messages[0].role == "system":
                    raise
                # a template without a system role: the fallback's tool list goes in the first user turn
                again, _ = template_messages(messages, plan, preamble_in_user=True)
                return tok.encode_chat(again, add_generation_prompt, tools=None, template=template, **kwargs)
        try:
            ids = await asyncio.to_thread(encode)
        except ValueError as e:
            raise APIError(400, str(e), "messages")
        except Exception as e:  # jinja2 template errors (raise_exception in the template, bad roles)
            raise APIError(400, f"the chat template failed on these messages: {e}", "messages")
        if not ids:
            raise APIError(400, "the rendered chat prompt is empty", "messages")
        return ids

    @staticmethod
    def best_of(best_of: Optional[int], n: int, stream: bool) -> int:
        """Candidates per prompt: best_of (default n), at least n, not streamed (OpenAI's rules)."""
        if best_of is None or best_of == n:
            return n
        if not n <= best_of <= MAX_CHOICES:
            raise APIError(400, f"best_of must be between n={n} and {MAX_CHOICES}, got {best_of}", "best_of")
        if stream:
            raise APIError(400, "best_of > n cannot be streamed (the best are known only at the end)", "best_of")
        return best_of

    @staticmethod
    def choices(n: Optional[int]) -> int:
        n = 1 if n is None else n
        if not 1 <= n <= MAX_CHOICES:
            raise APIError(400, f"n must be between 1 and {MAX_CHOICES}, got {n}", "n")
        return n

    def tokenize(self, prompt) -> list[int]:
        try:
            ids = self.engine.tokenize(prompt)
        except ValueError as e:
            raise APIError(400, str(e), "prompt")
        if not ids:
            raise APIError(400, "the prompt is empty: it must hold at least one token", "prompt")
        return ids

    def max_tokens_for(self, requested: Optional[int], prompt_len: int, param: str) -> int:
        ctx = self.engine.max_model_len
        if requested is not None and requested < 1:
            raise APIError(400, f"{param} must be at least 1, got {requested}", param)
        if prompt_len >= ctx:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context holds {ctx} "
                                "tokens (max_model_len), leaving no room to generate", "prompt",
                           "context_length_exceeded")
        if requested is None:
            return ctx - prompt_len
        if prompt_len + requested > ctx:
            raise APIError(400, f"this model's maximum context length is {ctx} tokens; you requested "
                                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
                                f"for the completion): reduce the prompt or {param}", param,
                           "context_length_exceeded")
        return requested

    def sampling(self, req: P._SamplingFields, max_tokens: int, logprobs: Optional[int],
                 structured: Optional[StructuredOutput] = None,
                 prompt_logprobs: Optional[int] = None) -> SamplingParams:
        """The request's sampling; a field it leaves unset takes the model's generation_config.json
        value (sampling_defaults), else OpenAI's default."""
        d = self.sampling_defaults
        bias = []
        for key, value in (req.logit_bias or {}).items():
            try:
                bias.append((int(key), value))
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                               "logit_bias")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=d.get("temperature", 1.0) if req.temperature is None else req.temperature,
                top_p=d.get("top_p", 1.0) if req.top_p is None else req.top_p,
                top_k=d.get("top_k", -1) if req.top_k is None else req.top_k,
                seed=req.seed, stop=req.stop or (), stop_token_ids=req.stop_token_ids or (),
                ignore_eos=bool(req.ignore_eos), logprobs=logprobs,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=(d.get("repetition_penalty", 1.0) if req.repetition_penalty is None
                                    else req.repetition_penalty),
                logit_bias=bias, min_tokens=req.min_tokens or 0, structured=structured,
                prompt_logprobs=prompt_logprobs)
        except ValueError as e:
            msg = str(e)
            raise APIError(400, msg, msg.split(" ", 1)[0])

    async def structured(self, req: P._SamplingFields, plan: Optional[ToolPlan] = None) -> Optional[StructuredOutput]:
        """The request's output constraint, compiled once here (off the event loop) so that a bad
        one is a 400 naming its field before anything is queued; a forced tool call's grammar
        (plan) is one too."""
        spec, param = structured_output(req)
        if plan is not None and plan.forced:
            if spec is not None:
                raise APIError(400, f"tool_choice {plan.function or plan.choice!r} constrains the output to a "
                                    f"tool call; it cannot be combined with {param}", param)
            spec, param = plan.structured, "tools"
        if spec is None:
            return None
        grammars = self.engine.grammars
        if grammars is None:
            raise APIError(400, f"{param}: structured output needs the model's tokenizer.json", param)
        try:
            await asyncio.to_thread(grammars.check, spec)
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", param) from None
        return spec

    async def submit(self, prompts: list[list[int]], params: SamplingParams, lora: Optional[str],
                     model: str, n: int = 1) -> list[RequestStream]:
        """n streams per prompt, prompt-major (OpenAI's choice index). A prompt's other choices
        follow its first one: they wait for its prefill and share its pages (one prefill), and
        draw their own random streams (seed + j when a seed is given)."""
        streams: list[RequestStream] = []
        try:
            for ids in prompts:
                lead = None
                for j in range(n):
                    p = params if j == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + j)
                    st = await self.aengine.submit(ids, p, lora, follows=lead)
                    lead = lead or st.request_id
                    streams.append(st)
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, QueueFullError):
                raise APIError(503, str(e), code="queue_full")
            if isinstance(e, EngineStoppedError):
                raise APIError(503, str(e), code="unavailable")
            if isinstance(e, (UnknownAdapterError, AdapterUnloadingError)):
                raise APIError(404, f"the model {model!r} does not exist: it is neither the base model "
                                    f"{self.base_name!r} nor a loaded LoRA adapter ({err_text(e)})",
                               "model", "model_not_found")
            if isinstance(e, ValueError):
                raise APIError(400, str(e))
            raise
        return streams

    async def collect(self, request: Request, streams: list[RequestStream],
                      done: Optional[Callable[[int, str], bool]] = None) -> Optional[list[Collected]]:
        """Run streams to the end (non-streaming); None if the client went away (all aborted).
        done(choice, text): called with each piece of a choice's text; True ends that choice
        there (aborted, finish_reason "stop")."""
        async def one(i: int, s: RequestStream) -> Collected:
            text, ids, lps, reason, prompt_lps = [], [], [], None, None
            async for d in s:
                text.append(d.text)
                ids.extend(d.token_ids)
                if d.logprobs:
                    lps.extend(d.logprobs)
                if d.prompt_logprobs is not None:
                    prompt_lps = d.prompt_logprobs
                over = done is not None and bool(d.text) and done(i, d.text)
                if d.finished:
                    reason = d.finish_reason
                elif over:
                    s.abort()
                    reason = "stop"
                    break
            if reason == "error":
                raise APIError(500, f"the request failed: {s.error or 'engine error'}", code="engine_error")
            return Collected(text="".join(text), token_ids=ids, logprobs=lps, finish_reason=reason,
                             prompt_tokens=len(s.prompt_token_ids), cached_tokens=s.num_cached_tokens,
                             prompt_ids=s.prompt_token_ids, prompt_logprobs=prompt_lps,
                             lora_version=s.lora_version)

        watcher = asyncio.create_task(_wait_disconnect(request))
        work = asyncio.ensure_future(asyncio.gather(*(one(i, s) for i, s in enumerate(streams))))
        try:
            done, _ = await asyncio.wait({watcher, work}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return work.result()
            return None
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
            for s in streams:
                s.abort()

    # ---- logprobs ----------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        tok = self.engine.tokenizer
        if tok is None:
            return f"token_id:{token_id}"
        return tok.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(self, lps: list, offset: int) -> P.CompletionLogprobs:
        out = P.CompletionLogprobs()
        for lp in lps:
            t = self.token_text(lp.token_id)
            out.tokens.append(t)
            out.token_logprobs.append(float(lp.logprob))
            out.top_logprobs.append({self.token_text(i): float(v) for i, v in lp.top})
            out.text_offset.append(offset)
            offset += len(t)
        return out

    def echo_logprobs(self, prompt_ids: list[int], prompt_lps: Optional[list]) -> P.CompletionLogprobs:
        """The prompt's part of an echoed completion's logprobs: its tokens, each one's logprob
        after the ones before it (the first has none: null) and its top alternatives."""
        first = self.token_text(prompt_ids[0])
        out = P.CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0])
        _extend(out, self.completion_logprobs((prompt_lps or [])[1:], len(first)))
        return out

    def echoed(self, prompt_text: str, prompt_ids: list[int], prompt_lps: Optional[list], text: str,
               lps: Optional[list], want_logprobs: bool) -> tuple[str, Optional[P.CompletionLogprobs]]:
        """An echoed choice: the prompt then the completion, text and (when asked) logprobs."""
        if not want_logprobs:
            return prompt_text + text, None
        out = self.echo_logprobs(prompt_ids, prompt_lps)
        _extend(out, self.completion_logprobs(lps or [], len(prompt_text)))
        return prompt_text + text, out

    def prompt_text(self, raw) -> str:
        """The prompt as echoed: a string as given, token ids detokenized."""
        if isinstance(raw, str):
            return raw
        tok = self.engine.tokenizer
        return tok.decode(raw, skip_special_tokens=False) if tok is not None else ""

    def chat_logprobs(self, lps: list) -> P.ChatLogprobs:
        content = []
        for lp in lps:
            t = self.token_text(lp.token_id)
            tops = [P.TopLogprob(token=self.token_text(i), logprob=float(v),
                                 bytes=list(self.token_text(i).encode())) for i, v in lp.top]
            content.append(P.TokenLogprob(token=t, logprob=float(lp.logprob), bytes=list(t.encode()),
                                          top_logprobs=tops))
        return P.ChatLogprobs(content=content)

    # ---- adapter paths -----------------------------------------------------------------------
    def check_lora_path(self, raw: str) -> str:
        if not raw or "\x00" in raw:
            raise APIError(400, "lora_path must be a non-empty path", "lora_path")
        if self.lora_root is None:
            if not self.allow_any_lora_path:
                raise APIError(403, "loading adapters at run time is disabled: start the server with "
                                    "--lora-root DIR (adapters under DIR may be loaded) or "
                                    "--allow-any-lora-path", "lora_path", "lora_path_forbidden")
            return str(Path(raw).expanduser().resolve())
        p = Path(raw)
        if not p.is_absolute():
            p = self.lora_root / p
        resolved = p.resolve()  # follows symlinks and '..': the real place is what is checked
        if resolved != self.lora_root and self.lora_root not in resolved.parents:
            raise APIError(403, f"lora_path must lie inside the server's --lora-root; {raw!r} does not",
                           "lora_path", "lora_path_forbidden")
        return str(resolved)


def _extend(out: P.CompletionLogprobs, more: P.CompletionLogprobs) -> None:
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(out, field).extend(getattr(more, field))
