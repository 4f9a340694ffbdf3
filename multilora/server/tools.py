"""Tool calling on the chat route: a request's `tools`, `tool_choice` and `parallel_tool_calls`
checked and planned, its messages (assistant `tool_calls`, `role: "tool"` answers) put into the
chat template's shape, and the grammar that forces a call when `tool_choice` asks for one.

    plan = plan_tools(req, template, configured_parser)     # APIError(400) naming the field
    messages, tools = template_messages(req.messages, plan)  # what the template renders

A template that renders `tools` itself (Qwen2.5/3, Llama 3.1, Hermes, ...) gets them, and the
calls and answers in the messages, in transformers' shape (arguments as objects). One without a
tool format gets the documented fallback: the tools listed in a system preamble (Hermes' text),
calls written in the parser's syntax into the assistant's content, and each tool answer as a
user turn inside `<tool_response>` tags. With `required` or a named function the output is
constrained by llguidance to the parser's call syntax over the tools' parameter schemas, so
every call parses and its arguments validate; `auto` leaves the output free and reads calls
out of it (multilora.server.tool_parsers).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from typing import Optional

from multilora.engine.structured import StructuredOutput
from multilora.engine.tokenizer import template_has_tools
from multilora.server import protocol as P
from multilora.server.errors import APIError
from multilora.server.tool_parsers import HERMES_END, HERMES_START, TOOL_CALL_PARSERS

MAX_TOOLS = 128                                    # OpenAI's limit
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")        # OpenAI's rule for a function's name
# the JSON a forced call is written in: compact, with the spaces json.dumps (and so the templates'
# tojson, and models trained on them) puts after ',' and ':'
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SEPARATOR = {"hermes": "\n", "llama3_json": "; "}
_ARGS_KEY = {"hermes": "arguments", "llama3_json": "parameters"}


@dataclasses.dataclass
class ToolPlan:
    """What a chat request does with tools."""
    tools: list[dict]                  # OpenAI's shape, {"type": "function", "function": {...}}
    choice: str                        # "none", "auto", "required" or "function" (named)
    parser: Optional[str]              # the call syntax read (and forced); None: calls not read
    native: bool                       # the template renders the tools itself
    structured: Optional[StructuredOutput] = None   # the forced call's grammar
    function: Optional[str] = None     # the named function

    @property
    def forced(self) -> bool:
        return self.structured is not None

    @property
    def parses(self) -> bool:
        """Whether the output is read for calls."""
        return self.parser is not None and self.choice != "none" and bool(self.tools)


def detect_parser(template: Optional[str]) -> str:
    """The call syntax a chat template's own tool format uses: Llama 3.1's JSON when it writes
    `<|python_tag|>`, else Hermes' `<tool_call>` (also multilora's fallback)."""
    return "llama3_json" if template and "<|python_tag|>" in template else "hermes"


def plan_tools(req: P.ChatCompletionRequest, template: Optional[str], configured: str,
               reasoning: Optional[str] = None) -> ToolPlan:
    """configured: the server's --tool-call-parser ("auto": from the template, or "none");
    reasoning: its --reasoning-parser (a forced call may follow the reasoning)."""
    tools = _check_tools(req.tools or [])
    choice, function = _check_choice(req.tool_choice, tools)
    native = template_has_tools(template)
    if configured == "none":
        if req.tool_choice == "auto":
            raise APIError(400, 'tool_choice "auto" needs a tool call parser: start the server with '
                                f"--tool-call-parser ({', '.join(TOOL_CALL_PARSERS)} or auto), or send "
                                '"none", "required" or a named function', "tool_choice")
        parser = None
    else:
        parser = detect_parser(template if native else None) if configured == "auto" else configured
    plan = ToolPlan(tools=tools, choice=choice, parser=parser, native=native, function=function)
    if choice in ("required", "function"):
        one = choice == "function" or req.parallel_tool_calls is False
        chosen = [t for t in tools if choice == "required" or t["function"]["name"] == function]
        plan.parser = plan.parser or detect_parser(template if native else None)
        plan.structured = StructuredOutput("grammar", call_grammar(chosen, plan.parser, one, reasoning))
    return plan


def _check_tools(tools: list[P.ChatTool]) -> list[dict]:
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools: at most {MAX_TOOLS} functions, got {len(tools)}", "tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if not NAME.match(fn.name):
            raise APIError(400, f"tools[{i}].function.name {fn.name!r} must be 1 to 64 letters, digits, "
                                "'_' or '-'", "tools")
        if fn.name in seen:
            raise APIError(400, f"tools: the function name {fn.name!r} is given twice", "tools")
        seen.add(fn.name)
        params = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
        if params.get("type", "object") != "object":
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema of type \"object\" "
                                f"(the arguments are an object), got type {params.get('type')!r}", "tools")
        entry = {"name": fn.name}
        if fn.description is not None:
            entry["description"] = fn.description
        entry["parameters"] = params
        out.append({"type": "function", "function": entry})
    return out


def _check_choice(choice, tools: list[dict]) -> tuple[str, Optional[str]]:
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice == "required" and not tools:
            raise APIError(400, 'tool_choice "required" needs tools: send the functions in tools', "tool_choice")
        return choice, None
    name = choice.function.name
    if name not in names:
        known = ", ".join(repr(n) for n in names) or "none: tools is empty"
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among tools "
                            f"(given: {known})", "tool_choice")
    return "function", name


# ---- the forced call's grammar --------------------------------------------------------------------
def closed(schema):
    """A copy of schema where an object that lists `properties` and says nothing of
    `additionalProperties` takes no others (xgrammar's strict mode, vLLM's default, does the
    same): a small model otherwise invents arguments until max_tokens. What it accepts still
    validates against the original."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            out[key] = {k: closed(v) for k, v in value.items()}
        elif key in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties", "not",
                     "if", "then", "else", "contains"):
            out[key] = closed(value)
        else:
            out[key] = value
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def call_schema(tool: dict, parser: str) -> dict:
    """The JSON schema of one call object: the function's name, then its arguments (closed; their
    own $defs move to the root, where their references point)."""
    fn = tool["function"]
    params = closed(copy.deepcopy(fn["parameters"]))
    defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
    key = _ARGS_KEY[parser]
    return {"x-guidance": _JSON_STYLE, "type": "object",
            "properties": {"name": {"const": fn["name"]}, key: params},
            "required": ["name", key], "additionalProperties": False, **defs}


def call_grammar(tools: list[dict], parser: str, one: bool, reasoning: Optional[str] = None) -> str:
    """A Lark grammar (llguidance's dialect) of one call, or one or more, of these tools in the
    parser's syntax; with a reasoning parser, after the reasoning (free text up to the first
    `</think>`: qwen3's optional and opened by `<think>`, deepseek_r1's always there)."""
    alternatives = " | ".join(f"f{i}" for i in range(len(tools)))
    calls = f'call{"" if one else f" ({json.dumps(_SEPARATOR[parser])} call)*"}'
    if reasoning is None:
        lines = [f"start: {calls}"]
    else:
        lines = [f"start: {'think?' if reasoning == 'qwen3' else 'think'} {calls}",
                 r"think: think_text /[ \n]*/",
                 rf'think_text[lazy]: {json.dumps("<think>") if reasoning == "qwen3" else ""} /(.|\n)*/ "</think>"']
    if parser == "hermes":
        lines.append(f'call: {json.dumps(HERMES_START + chr(10))} body {json.dumps(chr(10) + HERMES_END)}')
    else:
        lines.append("call: body")
    lines.append(f"body: {alternatives}")
    lines += [f"f{i}: %json {json.dumps(call_schema(t, parser))}" for i, t in enumerate(tools)]
    return "\n".join(lines) + "\n"


# ---- messages in the template's shape ---------------------------------------------------------------
def _text(m: P.ChatMessage, i: int) -> str:
    content = m.content
    if isinstance(content, list):
        if any(part.type != "text" for part in content):
            raise APIError(400, f"messages[{i}]: only text content parts are supported", "messages")
        content = "".join(part.text or "" for part in content)
    return content or ""


def _arguments(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def call_text(calls: list[P.ToolCall], parser: str) -> str:
    """Calls as the parser's syntax writes them (the fallback's assistant turns)."""
    key = _ARGS_KEY[parser]
    objs = [json.dumps({"name": c.function.name, key: _arguments(c.function.arguments)}, ensure_ascii=False)
            for c in calls]
    if parser == "hermes":
        return "\n".join(f"{HERMES_START}\n{o}\n{HERMES_END}" for o in objs)
    return "; ".join(objs)


def preamble(tools: list[dict], parser: str) -> str:
    """The fallback's system text: the tools and how to call them (Hermes' words)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if parser == "hermes":
        how = ("For each function call, return a json object with function name and arguments within "
               f"{HERMES_START}{HERMES_END} XML tags:\n{HERMES_START}\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n' + HERMES_END)
    else:
        how = ('To call a function, respond with a JSON object (several: separated by "; ") in the format '
               '{"name": <function-name>, "parameters": <args-json-object>}')
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n"
            f"</tools>\n\n{how}")


def template_messages(messages: list[P.ChatMessage], plan: Optional[ToolPlan],
                      preamble_in_user: bool = False) -> tuple[list[dict], Optional[list[dict]]]:
    """The messages (and tools) to render. Native: transformers' shape. Fallback (no tool format
    in the template, and tools or calls present): plain turns as the module's docstring says;
    preamble_in_user puts the preamble into the first user turn (templates without a system role)."""
    tools = plan.tools if plan is not None else []
    native = plan is not None and plan.native
    parser = (plan.parser if plan is not None else None) or "hermes"
    out: list[dict] = []
    for i, m in enumerate(messages):
        text = _text(m, i)
        if native or not (m.tool_calls or m.role == "tool"):
            msg = {"role": m.role, "content": text}
            if m.name:
                msg["name"] = m.name
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name,
                                                   "arguments": _arguments(c.function.arguments)}}
                                     for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None:  # Qwen3's template shows the last turns' reasoning
                msg["reasoning_content"] = m.reasoning_content
            out.append(msg)
        elif m.role == "tool":
            answer = f"<tool_response>\n{text}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + answer
            else:
                out.append({"role": "user", "content": answer, "_tool": True})
        else:
            calls = call_text(m.tool_calls, parser)
            out.append({"role": m.role, "content": f"{text}\n{calls}" if text else calls})
    for msg in out:
        msg.pop("_tool", None)
    if tools and not native:
        pre = preamble(tools, parser)
        if out and out[0]["role"] == "system":
            out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{pre}" if out[0]["content"] else pre)
        elif preamble_in_user:
            first = next((j for j, msg in enumerate(out) if msg["role"] == "user"), None)
            if first is None:
                out.insert(0, {"role": "user", "content": pre})
            else:
                out[first] = dict(out[first], content=f"{pre}\n\n{out[first]['content']}")
        else:
            out.insert(0, {"role": "system", "content": pre})
    return out, ((tools or None) if native else None)
