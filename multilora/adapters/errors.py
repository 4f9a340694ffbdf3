"""The error of an adapter that cannot be served (multilora.adapters.adapter re-exports it): in a
module of its own so that the modules adapter.py reads layouts with (per_expert) raise it too."""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter folder that cannot be served; the message names the adapter and the reason."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"LoRA adapter {name!r}: {reason}")
        self.adapter_name = name
        self.reason = reason
