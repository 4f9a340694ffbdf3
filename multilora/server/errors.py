"""OpenAI's error JSON for the server: APIError (status, message, param, code), the response it
becomes, request bodies parsed into the protocol models with errors that name the field, and
engine calls whose "stopped" becomes a 503."""

from __future__ import annotations

import re
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from multilora.server import protocol as P
from multilora.server.async_engine import EngineStoppedError


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: Optional[str] = None,
                   code: Optional[str] = None, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(P.error_body(status, message, param, code), status_code=status, headers=headers)


# ---- guards: API key and body size (a plain ASGI middleware, so that it sees the raw stream) -----
def field_path(loc) -> str:
    """A pydantic error's location as a client wrote the field: `messages[0].content[1].text`
    (pydantic's union and type tags, such as `list[...]` or `str`, left out)."""
    out = ""
    for x in loc:
        if isinstance(x, int):
            out += f"[{x}]"
        elif not ("[" in x or x in ("str", "int", "float", "bool")):
            out += f".{x}" if out else x
    return out


def describe_validation(e: ValidationError) -> tuple[str, Optional[str]]:
    errs = e.errors()
    if errs and errs[0]["type"] == "json_invalid":
        return f"the body is not valid JSON: {errs[0].get('ctx', {}).get('error', errs[0]['msg'])}", None
    for err in errs:  # ours first: a field not taken, or not acted on (protocol.OFF_ONLY)
        if err["type"] == "extra_forbidden":
            where = field_path(err["loc"])
            return (f"unknown field {where}: this server does not take it (/openapi.json lists the "
                    "fields of each route)", str(err["loc"][-1]))
        if err["type"] == "value_error" and "is not supported by this server" in err["msg"]:
            msg = err["msg"].removeprefix("Value error, ")
            where = field_path(err["loc"])
            return (f"{where}: {msg}" if where else msg), msg.split(" ", 1)[0]
    parts, param = [], None
    seen = set()
    for err in errs:
        where = field_path(err["loc"])
        if err["type"] == "model_type" and not where:
            return "the body must be a JSON object", None
        if param is None and where:
            param = re.split(r"[.\[]", where, maxsplit=1)[0]
        if where in seen:
            continue
        seen.add(where)
        parts.append(f"{where or 'body'}: {err['msg']}")
    return "invalid request: " + "; ".join(parts[:4]), param


def parse_json_body(body: bytes, model: type[BaseModel]):
    """The raw body as `model`, or APIError(400) saying what is wrong with it."""
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        msg, param = describe_validation(e)
        raise APIError(400, msg, param)


async def parse_body(request: Request, model: type[BaseModel]):
    return parse_json_body(await request.body(), model)


async def call_engine(coro):
    try:
        return await coro
    except EngineStoppedError as e:
        raise APIError(503, str(e), code="unavailable")


def err_text(e: BaseException) -> str:
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
