"""LoRA compute, below the model: the backends (shrink and expand over a pool of rank rows) and the
batch info they read. Adapter management lives above the model, in multilora.adapters."""
