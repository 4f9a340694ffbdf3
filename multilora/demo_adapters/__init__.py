"""The demo LoRA adapters shipped with multilora for the embedded default model
(SmolLM2-135M-Instruct): `shout` answers in CAPITAL LETTERS, `signoff` ends its answers with
"-- sent by multilora". `multilora serve` without --model or --lora-modules serves both.
They are made by scripts/make_demo_adapters.py; see README.md here.
"""

from __future__ import annotations

from pathlib import Path

DEMO_ADAPTERS_DIR = Path(__file__).resolve().parent
DEMO_ADAPTER_NAMES = ("shout", "signoff")
SIGNOFF = "-- sent by multilora"


def demo_lora_modules() -> dict[str, str]:
    """name -> folder of each demo adapter present in the installed package."""
    out = {}
    for name in DEMO_ADAPTER_NAMES:
        folder = DEMO_ADAPTERS_DIR / name
        if (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file():
            out[name] = str(folder)
    return out
