"""Structured output on the wire: OpenAI's `response_format` and vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs` extras, turned into
one StructuredOutput (multilora.engine.structured). At most one constraint per request; anything
malformed is a 400 naming the field.

    spec, param = structured_output(req)     # (None, None) when the request has no constraint
"""

from __future__ import annotations

from typing import Any, Optional

from multilora.engine.structured import StructuredOutput
from multilora.server.errors import APIError

# vLLM's guided_decoding_backend values that mean "whichever engine the server has"
BACKENDS = ("auto", "guidance", "llguidance")
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _from_response_format(rf: dict) -> Optional[StructuredOutput]:
    kind = rf.get("type")
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        raise APIError(400, f"response_format: unknown field {sorted(extra)[0]!r}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise APIError(400, "response_format: type json_schema needs a json_schema object "
                                '({"name": ..., "schema": {...}})', "response_format")
        bad = set(js) - {"name", "schema", "strict", "description"}
        if bad:
            raise APIError(400, f"response_format.json_schema: unknown field {sorted(bad)[0]!r} (it takes "
                                "name, schema, strict, description)", "response_format")
        if "schema" not in js or js["schema"] is None:
            return StructuredOutput("json_object")  # a schema-less json_schema: any JSON object
        return StructuredOutput.json_schema(js["schema"])
    raise APIError(400, f"response_format: type must be text, json_object or json_schema, got {kind!r}",
                   "response_format")


def _one(param: str, value: Any) -> StructuredOutput:
    if param in ("guided_json", "structured_outputs.json"):
        return StructuredOutput.json_schema(value)
    if param in ("guided_choice", "structured_outputs.choice"):
        return StructuredOutput.choice(value)
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty string")
    kind = "regex" if param.endswith("regex") else "grammar"
    return StructuredOutput(kind, value)


def structured_output(req) -> tuple[Optional[StructuredOutput], Optional[str]]:
    """The request's constraint and the field it came from; APIError(400) when malformed."""
    backend = getattr(req, "guided_decoding_backend", None)
    if backend is not None and backend not in BACKENDS:
        raise APIError(400, f"guided_decoding_backend {backend!r} is not available: this server uses "
                            f"llguidance (send one of {', '.join(BACKENDS)}, or leave it out)",
                       "guided_decoding_backend")
    found: list[tuple[str, Any]] = []
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(req, name, None) is not None:
            found.append((name, getattr(req, name)))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise APIError(400, "structured_outputs must be an object with one of "
                                f"{', '.join(STRUCTURED_KEYS)}", "structured_outputs")
        bad = set(so) - set(STRUCTURED_KEYS)
        if bad:
            raise APIError(400, f"structured_outputs: {sorted(bad)[0]!r} is not supported (it takes one of "
                                f"{', '.join(STRUCTURED_KEYS)})", "structured_outputs")
        for key, value in so.items():
            if key == "json_object":
                if value not in (None, False, True):
                    raise APIError(400, "structured_outputs.json_object must be true or false",
                                   "structured_outputs")
                if value:
                    found.append(("structured_outputs.json_object", None))
            elif value is not None:
                found.append((f"structured_outputs.{key}", value))
    rf = getattr(req, "response_format", None)
    try:
        from_rf = _from_response_format(rf) if rf is not None else None
    except ValueError as e:
        raise APIError(400, f"response_format: {e}", "response_format") from None
    if from_rf is not None:
        found.append(("response_format", from_rf))
    if len(found) > 1:
        raise APIError(400, f"give at most one output constraint; got {', '.join(n for n, _ in found)}",
                       found[1][0].split(".")[0])
    if not found:
        return None, None
    param, value = found[0]
    top = param.split(".")[0]
    if isinstance(value, StructuredOutput):
        return value, top
    if param == "structured_outputs.json_object":
        return StructuredOutput("json_object"), top
    try:
        return _one(param, value), top
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", top) from None
