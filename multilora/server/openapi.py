"""The OpenAPI document: what each route takes and returns.

The routes parse their bodies themselves (so that errors are OpenAI's JSON with the fitting
status), which leaves FastAPI's generated document without request bodies; this module adds
them, and the responses, from the same pydantic models the routes validate with (protocol.py),
so /docs, client generators and schema-driven fuzzers see the real fields.
"""

from __future__ import annotations

from fastapi.openapi.utils import get_openapi

from multilora.server import protocol as P

_GENERATION = {"text/event-stream": {"schema": {"type": "string", "description":
                                                "with stream: true, server-sent events of chunks, then [DONE]"}}}
ROUTES = {
    # path: (request model(s), response model, extra response content for 200)
    "/v1/completions": ((P.CompletionRequest,), P.CompletionResponse, _GENERATION),
    "/v1/chat/completions": ((P.ChatCompletionRequest,), P.ChatCompletionResponse, _GENERATION),
    "/v1/tokenize": ((P.TokenizeCompletionRequest, P.TokenizeChatRequest), P.TokenizeResponse, {}),
    "/tokenize": ((P.TokenizeCompletionRequest, P.TokenizeChatRequest), P.TokenizeResponse, {}),
    "/v1/detokenize": ((P.DetokenizeRequest,), P.DetokenizeResponse, {}),
    "/detokenize": ((P.DetokenizeRequest,), P.DetokenizeResponse, {}),
    "/v1/models": ((), P.ModelList, {}),
    "/v1/load_lora_adapter": ((P.LoadLoRAAdapterRequest,), None, {"text/plain": {"schema": {"type": "string"}}}),
    "/v1/unload_lora_adapter": ((P.UnloadLoRAAdapterRequest,), None, {"text/plain": {"schema": {"type": "string"}}}),
}
ERRORS = {"400": "bad request", "401": "missing or wrong API key", "404": "unknown model or adapter",
          "413": "body too large", "500": "engine failure", "503": "overloaded or stopping"}


def build_openapi(app) -> dict:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-compatible multi-LoRA server (multilora); docs/server.md")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})

    def ref(model, mode: str) -> dict:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode=mode)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    err = ref(P.ErrorResponse, "serialization")
    for path, (requests, response, extra) in ROUTES.items():
        for op in doc["paths"].get(path, {}).values():
            if requests:
                body = ref(requests[0], "validation") if len(requests) == 1 else \
                    {"oneOf": [ref(m, "validation") for m in requests]}
                op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
            content = dict(extra)
            if response is not None:
                content["application/json"] = {"schema": ref(response, "serialization")}
            op["responses"] = {"200": {"description": "OK", "content": content},
                               **{code: {"description": why, "content": {"application/json": {"schema": err}}}
                                  for code, why in ERRORS.items()}}
    return doc


def install(app) -> None:
    def openapi():
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema
    app.openapi = openapi
