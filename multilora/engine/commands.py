"""The engine's state changes as typed commands: add a request, abort one, load, unload or mix
adapters, stop the followers. Each is applied in one place (`apply`, which calls the Engine's
method); the server's engine thread applies the ones its routes send, and on a multi-process
engine the leader records every command it applied and the followers replay them, in order, from
their wire form (JSON: `to_wire` / `from_wire`). Plain Python, no jax."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional, Sequence

from multilora.engine.request import SamplingParams


def params_dict(params: SamplingParams) -> dict:
    """SamplingParams -> JSON-able keyword arguments."""
    d = dataclasses.asdict(params)
    d["stop"], d["stop_token_ids"] = list(d["stop"]), [int(t) for t in d["stop_token_ids"]]
    return d


@dataclasses.dataclass(frozen=True)
class AddRequest:
    kind: ClassVar[str] = "add"
    prompt: Sequence[int]
    params: SamplingParams
    lora: Optional[str] = None
    request_id: Optional[str] = None
    follows: Optional[str] = None       # another choice of the same prompt (n > 1)

    def apply(self, engine) -> str:
        return engine.add_request(list(self.prompt), self.params, self.lora, self.request_id, self.follows)

    def fields(self) -> dict:
        return dict(prompt=list(self.prompt), params=params_dict(self.params), lora=self.lora,
                    request_id=self.request_id, follows=self.follows)

    @classmethod
    def from_fields(cls, kw: dict) -> "AddRequest":
        return cls(kw["prompt"], SamplingParams(**kw["params"]), kw["lora"], kw["request_id"], kw.get("follows"))


@dataclasses.dataclass(frozen=True)
class AbortRequest:
    kind: ClassVar[str] = "abort"
    request_id: str

    def apply(self, engine) -> bool:
        return engine.abort_request(self.request_id)


@dataclasses.dataclass(frozen=True)
class LoadAdapter:
    kind: ClassVar[str] = "load"
    name: str
    path: str
    pinned: bool = False
    load_inplace: bool = False

    def apply(self, engine) -> None:
        engine.load_lora_adapter(self.name, self.path, pinned=self.pinned, load_inplace=self.load_inplace)


@dataclasses.dataclass(frozen=True)
class UnloadAdapter:
    kind: ClassVar[str] = "unload"
    name: str

    def apply(self, engine) -> None:
        engine.unload_lora_adapter(self.name)


@dataclasses.dataclass(frozen=True)
class AddMix:
    kind: ClassVar[str] = "mix"
    weights: dict

    def apply(self, engine) -> str:
        return engine.add_mix(self.weights)


@dataclasses.dataclass(frozen=True)
class StopFollowers:
    """The leader stops: the followers' follow() returns (handled by the step's sync, not the
    engine)."""

    kind: ClassVar[str] = "stop"

    def apply(self, engine) -> None:
        pass


Command = AddRequest | AbortRequest | LoadAdapter | UnloadAdapter | AddMix | StopFollowers
COMMANDS: dict[str, Any] = {c.kind: c for c in (AddRequest, AbortRequest, LoadAdapter, UnloadAdapter, AddMix,
                                                 StopFollowers)}


def to_wire(cmd: Command) -> list:
    """[kind, fields]: JSON-able."""
    fields = cmd.fields() if hasattr(cmd, "fields") else dataclasses.asdict(cmd)
    return [cmd.kind, fields]


def from_wire(item: Sequence) -> Command:
    kind, kw = item
    cls = COMMANDS.get(kind)
    if cls is None:
        raise ValueError(f"unknown command {kind!r} from the leader")
    return cls.from_fields(kw) if hasattr(cls, "from_fields") else cls(**kw)
