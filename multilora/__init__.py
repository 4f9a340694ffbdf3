"""multilora: serve many LoRA adapters over one base language model, in JAX."""

__version__ = "0.1.0"
