"""The routes, as FastAPI routers that build_app (multilora.server.app) includes: generation
(/v1/completions, /v1/chat/completions), vLLM's tokenizer routes, models and adapters,
operations (/health, /metrics). Each handler finds the app's Server (what the routes share,
multilora.server.service) and AsyncEngine on `request.app.state`."""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from multilora.adapters.registry import AdapterConflictError
from multilora.server import protocol as P
from multilora.server.async_engine import AsyncEngine
from multilora.server.chat_output import ChatOutput
from multilora.server.errors import APIError, call_engine, err_text, error_response, parse_body
from multilora.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from multilora.server.service import MAX_ADAPTER_NAME, Collected, Server
from multilora.server.streaming import SSEResponse, chat_stream, completion_stream

log = logging.getLogger("multilora.server")


def _state(request: Request) -> tuple[Server, AsyncEngine]:
    """The app's Server and AsyncEngine (build_app puts them on app.state)."""
    return request.app.state.server, request.app.state.async_engine


# ---- generation ----------------------------------------------------------------------------
generation = APIRouter()


@generation.post("/v1/completions")
async def completions(request: Request):
    srv = _state(request)[0]
    req: P.CompletionRequest = await parse_body(request, P.CompletionRequest)
    lora = await srv.request_adapter(req)
    raw = req.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]
    if not raw:
        raise APIError(400, "the prompt is empty", "prompt")
    prompts = await asyncio.to_thread(lambda: [srv.tokenize(p) for p in raw])  # long prompts: off the loop
    echo = bool(req.echo)
    # echo with max_tokens 0: score the prompt only (older lm-eval's loglikelihood; its
    # local-completions sends max_tokens 1 and drops that token itself); one token is
    # generated (the prefill samples it anyway) and dropped
    score_only = echo and req.max_tokens == 0
    for ids in prompts:
        srv.max_tokens_for(1 if score_only else req.max_tokens, len(ids), "max_tokens")
    # max_tokens null: up to the context, which the engine bounds per prompt
    max_tokens = 1 if score_only else req.max_tokens if req.max_tokens is not None else srv.engine.max_model_len
    n = srv.choices(req.n)
    best_of = srv.best_of(req.best_of, n, bool(req.stream))
    # best_of: every candidate reports its chosen tokens' logprobs, to be ranked by their sum
    params = srv.sampling(req, max_tokens, req.logprobs if best_of == n else (req.logprobs or 0),
                          await srv.structured(req), req.logprobs if echo else None)
    streams = await srv.submit(prompts, params, lora, req.model, best_of)
    echo_texts = [srv.prompt_text(p) for p in raw for _ in range(best_of)] if echo else None
    rid, created = P.random_id("cmpl"), P.now()
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return SSEResponse(completion_stream(srv, streams, req.model, rid, created, include_usage, n,
                                             echo_texts, score_only), streams)
    results = await srv.collect(request, streams)
    if results is None:
        return Response(status_code=499)
    for i, r in enumerate(results):
        r.echo = echo_texts[i] if echo else None
        if score_only:
            r.text, r.token_ids, r.logprobs, r.finish_reason = "", [], [], "length"
    usage = _usage(results, best_of)
    if best_of > n:
        results = _best(results, best_of, n)
    choices = []
    for i, r in enumerate(results):
        text, lp = r.text, None
        if echo:
            text, lp = srv.echoed(r.echo, r.prompt_ids, r.prompt_logprobs, r.text, r.logprobs,
                                  req.logprobs is not None)
        elif req.logprobs is not None:
            lp = srv.completion_logprobs(r.logprobs, 0)
        choices.append(P.CompletionChoice(index=i, text=text, finish_reason=r.finish_reason, logprobs=lp))
    return P.CompletionResponse(id=rid, created=created, model=req.model, choices=choices,
                                usage=usage, system_fingerprint=results[0].lora_version if results else None)


@generation.post("/v1/chat/completions")
async def chat_completions(request: Request):
    srv = _state(request)[0]
    req: P.ChatCompletionRequest = await parse_body(request, P.ChatCompletionRequest)
    lora = await srv.request_adapter(req)
    template = await srv.chat_template(lora)
    plan = srv.tool_plan(req, template)
    ids = await srv.chat_ids(req.messages, req.add_generation_prompt, plan, template, req.chat_template_kwargs)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = srv.max_tokens_for(requested, len(ids), param)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    if req.echo:
        raise APIError(400, "echo is not supported on /v1/chat/completions (it is on /v1/completions); "
                            "leave it out or send false", "echo")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = srv.sampling(req, max_tokens, logprobs, await srv.structured(req, plan))
    n = srv.choices(req.n)
    streams = await srv.submit([ids], params, lora, req.model, n)
    rid, created = P.random_id("chatcmpl"), P.now()

    def output() -> ChatOutput:  # one per choice: its reasoning, then its calls
        return ChatOutput(srv.reasoning_parser, plan.parser if plan.parses else None,
                          1 if req.parallel_tool_calls is False else None)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return SSEResponse(chat_stream(srv, streams, req.model, rid, created, include_usage,
                                         bool(req.logprobs), n, output), streams)
    outs = [output() for _ in streams]

    def done(i: int, text: str) -> bool:  # read as it comes: a repeated call (or one too many) ends it
        outs[i].feed(text)
        return outs[i].over
    results = await srv.collect(request, streams, done)
    if results is None:
        return Response(status_code=499)
    choices = []
    for i, r in enumerate(results):
        outs[i].finish()
        message, finish_reason = outs[i].result(r.finish_reason)
        choices.append(P.ChatChoice(index=i, message=message, finish_reason=finish_reason,
                                    logprobs=srv.chat_logprobs(r.logprobs) if req.logprobs else None))
    return P.ChatCompletionResponse(id=rid, created=created, model=req.model, choices=choices,
                                    usage=_usage(results, n), system_fingerprint=results[0].lora_version)


# ---- vLLM's tokenizer routes (also without /v1, where vLLM serves them) ----------------------
tokenizer = APIRouter()


@tokenizer.post("/v1/tokenize")
@tokenizer.post("/tokenize")
async def tokenize(request: Request):
    srv = _state(request)[0]
    body = await request.body()
    try:
        parsed = json.loads(body or b"{}")
    except ValueError:
        parsed = None  # parse_body reports the bad JSON
    is_chat = isinstance(parsed, dict) and "messages" in parsed  # anything but an object: parse_body's 400
    req = await parse_body(request, P.TokenizeChatRequest if is_chat else P.TokenizeCompletionRequest)
    if req.model is not None:
        await srv.known_model(req.model)
    tok = srv.engine.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer", "prompt")
    if is_chat:
        lora = await srv.resolve_model(req.model) if req.model is not None else None
        template = await srv.chat_template(lora)
        plan = srv.tool_plan(P.ChatCompletionRequest(model="", messages=[], tools=req.tools), template) \
            if req.tools else None
        ids = await srv.chat_ids(req.messages, req.add_generation_prompt, plan, template,
                                 req.chat_template_kwargs)
    else:
        ids = await asyncio.to_thread(tok.encode, req.prompt, req.add_special_tokens)
    return P.TokenizeResponse(count=len(ids), max_model_len=srv.engine.max_model_len, tokens=ids,
                              token_strs=[tok.id_to_token(i) or "" for i in ids])


@tokenizer.post("/v1/detokenize")
@tokenizer.post("/detokenize")
async def detokenize(request: Request):
    srv = _state(request)[0]
    req: P.DetokenizeRequest = await parse_body(request, P.DetokenizeRequest)
    if req.model is not None:
        await srv.known_model(req.model)
    tok = srv.engine.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer", "tokens")
    vocab = srv.engine.cfg.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "tokens")
    return P.DetokenizeResponse(prompt=tok.decode(req.tokens, skip_special_tokens=False))


# ---- models and adapters -------------------------------------------------------------------
adapters = APIRouter()


@adapters.get("/v1/models")
async def models(request: Request):
    srv, async_engine = _state(request)
    adapters = await call_engine(async_engine.list_lora_adapters())
    cards = [P.ModelCard(id=srv.base_name, root=str(srv.engine.model_path),
                         max_model_len=srv.engine.max_model_len)]
    cards += [P.ModelCard(id=a["name"], root=a["path"], parent=srv.base_name,
                          max_model_len=srv.engine.max_model_len, version=a.get("version"))
              for a in adapters if not a.get("unloading")]
    return P.ModelList(data=cards)


@adapters.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request):
    srv, async_engine = _state(request)
    req: P.LoadLoRAAdapterRequest = await parse_body(request, P.LoadLoRAAdapterRequest)
    name = req.lora_name
    if not name or len(name) > MAX_ADAPTER_NAME or any(ord(c) < 32 for c in name):
        raise APIError(400, f"lora_name must be 1 to {MAX_ADAPTER_NAME} printable characters", "lora_name")
    if name in srv.base_names:
        raise APIError(409, f"lora_name {name!r} is the base model's name; choose another", "lora_name",
                       "adapter_conflict")
    path = srv.check_lora_path(req.lora_path)
    try:
        await call_engine(async_engine.load_lora_adapter(name, path, pinned=req.pinned,
                                                         load_inplace=req.load_inplace))
    except AdapterConflictError as e:
        raise APIError(409, str(e), "lora_name", "adapter_conflict")
    except ValueError as e:  # AdapterError: the folder is not a servable adapter
        raise APIError(400, str(e), "lora_path", "invalid_adapter")
    log.info("loaded LoRA adapter %r from %s%s", name, path, " in place" if req.load_inplace else "")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@adapters.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    srv, async_engine = _state(request)
    req: P.UnloadLoRAAdapterRequest = await parse_body(request, P.UnloadLoRAAdapterRequest)
    name = req.lora_name
    if name in srv.base_names:
        raise APIError(400, "the base model cannot be unloaded", "lora_name")
    try:
        await call_engine(async_engine.unload_lora_adapter(name))
    except KeyError as e:
        raise APIError(404, err_text(e), "lora_name", "adapter_not_found")
    log.info("unloading LoRA adapter %r", name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


# ---- operations ----------------------------------------------------------------------------
operations = APIRouter()


@operations.get("/health")
async def health(request: Request):
    async_engine = _state(request)[1]
    if not async_engine.is_alive:
        return error_response(503, async_engine.not_running_reason, code="unavailable")
    # 200 as soon as requests are served; "warmup" says how many of the step shapes are compiled
    # yet (a server compiles most of them in the background after its first shapes)
    engine = async_engine.engine  # precision: what runs (dtype as asked, each part's dtype)
    return JSONResponse({"status": "ok", "warmup": engine.runner.warmup_status(),
                         "precision": engine.precision.as_dict()})


@operations.get("/metrics")
async def metrics(request: Request):
    async_engine = _state(request)[1]
    return Response(async_engine.metrics.render(), media_type=METRICS_CONTENT_TYPE)


def _best(results: list[Collected], best_of: int, n: int) -> list[Collected]:
    """Per prompt (best_of candidates each, prompt-major), the n with the highest cumulative
    logprob of their chosen tokens, best first (vLLM's ranking)."""
    out = []
    for i in range(0, len(results), best_of):
        group = results[i:i + best_of]
        out += sorted(group, key=lambda r: -r.cumulative_logprob)[:n]
    return out


def _usage(results: list[Collected], n: int = 1) -> P.UsageInfo:
    """A prompt counts once however many choices it has (OpenAI's usage with n > 1)."""
    prompt = sum(r.prompt_tokens for r in results[::n])
    completion = sum(len(r.token_ids) for r in results)
    return P.UsageInfo.of(prompt, completion, sum(r.cached_tokens for r in results[::n]))
