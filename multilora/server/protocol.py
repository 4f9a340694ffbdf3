"""The HTTP wire format: pydantic schemas of OpenAI's completions, chat completions, models and
error bodies, plus vLLM's extras (top_k, ignore_eos, stop_token_ids) and its adapter load/unload
bodies. No engine or jax here: app.py turns these into engine calls.

Requests validate strictly (a string where a number belongs is an error, not a guess) and
nothing is silently ignored: an unknown field is a 400 naming it, and a known field that
multilora does not act on (tools, audio, ...) is accepted only at the value that means
"off" (what clients send by default), else a 400 naming it. `user` and `metadata` are
informational and accepted as they are.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (OpenAI's limit too)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# Fields multilora does not act on, with the values that mean "off" (accepted: clients send
# them by default); any other value is refused naming the field. None (or absent) is always off.
OFF_ONLY: dict[str, tuple] = {
    "functions": ([],),
    "function_call": ("none",),
    "service_tier": ("auto", "default"),
    "store": (False,),
    "modalities": (["text"],),
    "prediction": (),
    "audio": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "suffix": ("",),
    # vLLM's extras
    "use_beam_search": (False,), "length_penalty": (1.0, 1),
    "min_p": (0.0, 0), "allowed_token_ids": (), "bad_words": ([],),
    "prompt_logprobs": (), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (), "priority": (0,), "continue_final_message": (False,),
    "chat_template": (), "documents": (), "mm_processor_kwargs": (),
    # message fields of a replayed assistant turn
    "refusal": (), "annotations": ([],),
}


def check_off(obj: BaseModel) -> None:
    for name in OFF_ONLY:
        if name in type(obj).model_fields:
            value = getattr(obj, name)
            if value is not None and not any(value == ok and type(value) is type(ok) for ok in OFF_ONLY[name]):
                raise ValueError(f"{name} is not supported by this server (got {value!r}); "
                                 f"leave it out{' or send ' + repr(OFF_ONLY[name][0]) if OFF_ONLY[name] else ''}")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="after")
    def _refuse_what_is_not_honoured(self):
        check_off(self)
        return self


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- shared --------------------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool = False


class PromptTokensDetails(_Response):
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class _SamplingFields(_Request):
    """Fields both generation routes share (OpenAI's, then vLLM's extras)."""

    model: str
    temperature: Optional[float] = None     # None: 1.0, OpenAI's default
    top_p: Optional[float] = None
    n: Optional[int] = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    # vLLM extras
    top_k: Optional[int] = None
    ignore_eos: Optional[bool] = False
    stop_token_ids: Optional[list[int]] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = 0
    # multilora's extra: an exact weighted mix of adapters, {"a": 0.7, "b": 0.3} (model: the base)
    adapters: Optional[dict[str, float]] = None
    # structured output (multilora.server.guided): OpenAI's, then vLLM's; at most one of them
    response_format: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    structured_outputs: Optional[dict[str, Any]] = None
    # known, not acted on: refused unless "off" (OFF_ONLY)
    service_tier: Optional[str] = None
    store: Optional[bool] = None
    prediction: Optional[Any] = None
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None
    min_p: Optional[float] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    prompt_logprobs: Optional[int] = None
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    truncate_prompt_tokens: Optional[int] = None
    priority: Optional[int] = None


# ---- /v1/completions -----------------------------------------------------------------------------
class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(_Response):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    # which adapter weights answered (its version tag: load count and content hash); None: the base model
    system_fingerprint: Optional[str] = None


# ---- /v1/chat/completions ------------------------------------------------------------------------
class ChatContentPart(_Request):
    type: str
    text: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data):
        """A part of another kind (image_url, input_audio, file, ...) is refused by its type, before
        its own fields are read as unknown ones: the models served take text only."""
        if isinstance(data, dict) and isinstance(data.get("type"), str) and data["type"] != "text":
            raise ValueError(f"type {data['type']!r} is not supported by this server: the models it serves "
                             "take text only (send parts of type 'text')")
        return data


# ---- tools (multilora.server.tools) ---------------------------------------------------------------
class FunctionDefinition(_Request):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None   # a JSON schema of the arguments (an object's)
    strict: Optional[bool] = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Request):
    name: str
    arguments: str   # JSON text of an object, as OpenAI sends it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: str
    content: Optional[Union[str, list[ChatContentPart]]] = None
    name: Optional[str] = None
    # an assistant turn's calls, and a tool turn's answer to one of them
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None   # a replayed reasoning turn (vLLM's; not rendered)
    refusal: Optional[str] = None
    annotations: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None              # None: whatever the context leaves
    max_completion_tokens: Optional[int] = None   # OpenAI's newer name; wins over max_tokens
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    modalities: Optional[list[str]] = None
    audio: Optional[Any] = None
    reasoning_effort: Optional[str] = None
    web_search_options: Optional[Any] = None
    # vLLM extras
    add_generation_prompt: bool = True
    echo: Optional[bool] = None
    continue_final_message: Optional[bool] = None
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    documents: Optional[list[Any]] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: Optional[list[TokenLogprob]] = None


def _drop_none(fields: tuple[str, ...]):
    """A serializer that leaves out these fields when they are None (as OpenAI's JSON does)."""
    def serialize(self, handler):
        out = handler(self)
        for f in fields:
            if out.get(f, 0) is None:
                del out[f]
        return out
    return model_serializer(mode="wrap")(serialize)


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    reasoning_content: Optional[str] = None   # vLLM's and SGLang's name (--reasoning-parser)
    _ser = _drop_none(("tool_calls", "reasoning_content"))


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(_Response):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Optional[UsageInfo] = None
    # which adapter weights answered (its version tag: load count and content hash); None: the base model
    system_fingerprint: Optional[str] = None


class DeltaFunctionCall(_Response):
    name: Optional[str] = None
    arguments: Optional[str] = None
    _ser = _drop_none(("name",))


class DeltaToolCall(_Response):
    """A streamed call: its first delta carries index, id, type and function.name (arguments
    ""), the next ones index and argument fragments only (OpenAI's stream)."""
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: DeltaFunctionCall
    _ser = _drop_none(("id", "type"))


class DeltaMessage(_Response):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None
    reasoning_content: Optional[str] = None
    # the role in a choice's first delta only, absent after (as OpenAI sends it; not null)
    _ser = _drop_none(("role", "tool_calls", "reasoning_content"))


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None
    # which adapter weights answered (its version tag: load count and content hash); None: the base model
    system_fingerprint: Optional[str] = None


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    # which adapter weights answered (its version tag: load count and content hash); None: the base model
    system_fingerprint: Optional[str] = None


# ---- /v1/models ----------------------------------------------------------------------------------
class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "multilora"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None
    version: Optional[str] = None   # multilora extra: an adapter's current version tag (system_fingerprint)


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---- vLLM's /tokenize and /detokenize -------------------------------------------------------------
class TokenizeCompletionRequest(_Request):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Request):
    model: Optional[str] = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    tools: Optional[list[ChatTool]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


# ---- vLLM's adapter routes -----------------------------------------------------------------------
class LoadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_path: str
    pinned: bool = False   # multilora extra: keep it in a device slot for good
    load_inplace: bool = False  # vLLM's: a loaded name takes the new weights (running requests keep theirs)


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_int_id: Optional[int] = None   # accepted for vLLM compatibility, unused


# ---- errors --------------------------------------------------------------------------------------
class ErrorInfo(_Response):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(_Response):
    error: ErrorInfo


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}


def error_body(status: int, message: str, param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "server_error"),
                                         param=param, code=code)).model_dump()
