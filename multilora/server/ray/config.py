"""Ray Serve deployment: its configuration (RayServeConfig, checked), the headers the ingress and
the replicas agree on, and the small pure helpers both use on request bodies and responses.
Ray is imported lazily: importing this module never needs it."""

from __future__ import annotations

import dataclasses
import hmac
import json
import urllib.parse
from typing import Optional

from multilora.server import protocol as P
from multilora.server.reasoning import REASONING_PARSERS
from multilora.server.tool_parsers import TOOL_CALL_PARSERS

DIRECTORY_NAMESPACE = "multilora"
REPLICA_HEADER = "x-multilora-replica"      # the replica that served the request
HELD_HEADER = "x-multilora-held"            # the adapters it held after taking this one
WARM_HEADER = "x-multilora-warm"            # 1: it held the request's adapter when the request arrived
ATTEMPTS_HEADER = "x-multilora-attempts"    # replicas tried: > 1 when a replica died before starting it
_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}


# ---- configuration -------------------------------------------------------------------------------
@dataclasses.dataclass
class RayServeConfig:
    """Everything the deployments need, picklable (it travels to every replica)."""
    engine_kwargs: dict                    # Engine(**engine_kwargs): model, lora_modules, config
    num_replicas: int = 2
    max_adapters_per_replica: int = 8      # serve.multiplexed's max_num_models_per_replica
    max_ongoing_requests: int = 64         # per replica; more wait in Serve's router
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    api_key: Optional[str] = None
    lora_root: Optional[str] = None
    allow_any_lora_path: bool = False
    max_body_bytes: int = 4 * 2**20
    max_queue: int = 512
    drain_timeout: float = 30.0
    max_attempts: int = 3                  # replicas a request that never started may be sent to
    app_name: str = "multilora"
    health_check_period_s: float = 2.0
    route_by_adapter: bool = True          # False: no multiplexed id (the benchmark's baseline)
    tool_call_parser: str = "auto"         # --tool-call-parser (docs/server.md)
    reasoning_parser: Optional[str] = None  # --reasoning-parser
    served_model_names: Optional[list[str]] = None  # --served-model-name (None: the folder's name and path)
    chat_template: Optional[str] = None    # --chat-template's text (None: the model's own)
    generation_config: str = "auto"        # --generation-config

    def __post_init__(self):
        check_config(self)

    @property
    def directory_name(self) -> str:
        return f"multilora-adapters-{self.app_name}"


def check_config(cfg: RayServeConfig) -> None:
    """Raise ValueError naming the setting that is wrong and what it may be."""
    if not isinstance(cfg.num_replicas, int) or cfg.num_replicas < 1:
        raise ValueError(f"num_replicas must be an integer >= 1, got {cfg.num_replicas!r}")
    if not isinstance(cfg.max_adapters_per_replica, int) or cfg.max_adapters_per_replica < 1:
        raise ValueError("max_adapters_per_replica must be an integer >= 1 (adapters a replica advertises "
                         f"to the router), got {cfg.max_adapters_per_replica!r}")
    if not isinstance(cfg.max_ongoing_requests, int) or cfg.max_ongoing_requests < 1:
        raise ValueError(f"max_ongoing_requests must be an integer >= 1, got {cfg.max_ongoing_requests!r}")
    if not isinstance(cfg.max_attempts, int) or cfg.max_attempts < 1:
        raise ValueError(f"max_attempts must be an integer >= 1, got {cfg.max_attempts!r}")
    if cfg.replica_cpus < 0 or cfg.replica_gpus < 0:
        raise ValueError(f"replica_cpus and replica_gpus must be >= 0, got {cfg.replica_cpus!r} and "
                         f"{cfg.replica_gpus!r}")
    if cfg.max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {cfg.max_queue!r}")
    if cfg.tool_call_parser not in ("auto", "none") + TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be auto, none or one of {', '.join(TOOL_CALL_PARSERS)}, "
                         f"got {cfg.tool_call_parser!r}")
    if cfg.reasoning_parser is not None and cfg.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                         f"got {cfg.reasoning_parser!r}")
    # the server options here, not in R replicas' starts
    from multilora.server.service import check_generation_config, check_served_names
    if cfg.served_model_names is not None:
        check_served_names(cfg.served_model_names, list(cfg.engine_kwargs.get("lora_modules") or {}))
    check_generation_config(cfg.generation_config)


# ---- small pure helpers --------------------------------------------------------------------------
def _body_object(body: bytes) -> dict:
    try:
        obj = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError):
        return {}
    return obj if isinstance(obj, dict) else {}


def request_model(body: bytes) -> tuple[Optional[str], bool]:
    """(the body's `model` when it is a string, whether it asks for an `adapters` mix). Anything
    unreadable gives (None, False): the replica's app reports what is wrong with it."""
    obj = _body_object(body)
    model = obj.get("model")
    return (model if isinstance(model, str) else None), obj.get("adapters") is not None


def mix_parts(body: bytes) -> list[str]:
    """The adapters an `adapters` mix names ({name: weight}); [] when there is none."""
    parts = _body_object(body).get("adapters")
    return [p for p in parts if isinstance(p, str)] if isinstance(parts, dict) else []


def multiplexed_id(model: Optional[str], mix: bool, base_names: set[str]) -> str:
    """The multiplexed model id a request is routed by: its adapter's name; "" (no affinity) for
    the base model, a mix (its parts are what is held) or no model at all."""
    if not model or mix or model in base_names:
        return ""
    return model


def entry_key(entry: dict) -> str:
    """What a replica records of a directory entry it registered: its path and rev (an in-place
    load keeps the name and may keep the path; the rev tells the new weights from the old)."""
    return f"{entry['path']}@{entry.get('rev', 0)}"


def stale_adapters(applied: dict[str, str], entries: dict[str, dict]) -> list[str]:
    """Adapters a replica registered from the directory (name -> entry_key) that the directory no
    longer has (to be unloaded there), or has under another path or rev (loaded in place there)."""
    return sorted(n for n, key in applied.items() if n not in entries or entry_key(entries[n]) != key)


def encode_names(names) -> str:
    """Adapter names for a header: percent-encoded, comma-separated (names may hold commas)."""
    return ",".join(urllib.parse.quote(n, safe="") for n in names)


def decode_names(value: str) -> list[str]:
    return [urllib.parse.unquote(n) for n in value.split(",")] if value else []


def bearer_ok(authorization: str, api_key: Optional[str]) -> bool:
    if not api_key:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.split(b";")[0].strip() == b"text/event-stream"
               for k, v in headers)


def relayed_headers(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The replica's response headers for the ingress's response (without hop-by-hop ones)."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in headers
            if k.decode("latin-1").lower() not in _HOP_BY_HOP}


def error_json(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> bytes:
    return json.dumps(P.error_body(status, message, param, code), separators=(",", ":")).encode()


def sse_error(status: int, message: str, code: Optional[str] = None) -> bytes:
    return b"data: " + error_json(status, message, None, code) + b"\n\n"


def replica_gone(exc: BaseException) -> bool:
    """Whether a call failed because its replica died or went away (not because of the request)."""
    import ray.exceptions
    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))
