"""LoRA compute backends, selected by name."""

from multilora.lora.backend.base import BaseLoRABackend
from multilora.lora.backend.bgmv import BgmvLoRABackend
from multilora.lora.backend.dense import DenseLoRABackend
from multilora.lora.backend.reference import ReferenceLoRABackend
from multilora.lora.backend.sgmv import SgmvLoRABackend

BACKENDS: dict[str, type[BaseLoRABackend]] = {
    "bgmv": BgmvLoRABackend,
    "sgmv": SgmvLoRABackend,
    "dense": DenseLoRABackend,
    "reference": ReferenceLoRABackend,
}
BACKEND_CHOICES = ("auto", *BACKENDS)


def get_backend(name: str) -> BaseLoRABackend:
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown lora_backend {name!r}; choose one of {', '.join(BACKEND_CHOICES)}") from None


def choose_backend(name: str, num_tokens: int, is_decode: bool, num_slots: int | None = None) -> str:
    """Resolve "auto" for one compiled shape (tokens and slots are both static there):
    decode reads the whole small pool once (`dense`) when the adapters are few next to the
    tokens, else gathers per token (`bgmv`); prefill groups tokens into tiles (`sgmv`)."""
    if name != "auto":
        get_backend(name)
        return name
    if is_decode or num_tokens <= 64:
        if num_slots is not None and 1 < num_slots and (num_slots - 1) * 4 <= num_tokens:
            return "dense"
        return "bgmv"
    return "sgmv"


__all__ = ["BaseLoRABackend", "BgmvLoRABackend", "SgmvLoRABackend", "DenseLoRABackend",
           "ReferenceLoRABackend",
           "get_backend", "choose_backend", "BACKENDS", "BACKEND_CHOICES"]
