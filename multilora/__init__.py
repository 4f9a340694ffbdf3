"""multilora: serve many LoRA adapters over one base language model, in JAX."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import multilora` stays light (no jax) until the engine is asked for.
    if name == "Engine":
        from multilora.engine.engine import Engine
        return Engine
    if name == "SamplingParams":
        from multilora.engine.request import SamplingParams
        return SamplingParams
    if name == "StructuredOutput":
        from multilora.engine.structured import StructuredOutput
        return StructuredOutput
    raise AttributeError(name)


__all__ = ["Engine", "SamplingParams", "StructuredOutput"]
