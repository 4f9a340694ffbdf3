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


def choose_backend(name: str, num_tokens: int, is_decode: bool) -> str:
    """Resolve "auto" for one compiled shape: per-token gathers for decode, tiles for prefill."""
    if name != "auto":
        get_backend(name)
        return name
    return "bgmv" if is_decode or num_tokens <= 64 else "sgmv"


__all__ = ["BaseLoRABackend", "BgmvLoRABackend", "SgmvLoRABackend", "DenseLoRABackend",
           "ReferenceLoRABackend",
           "get_backend", "choose_backend", "BACKENDS", "BACKEND_CHOICES"]
