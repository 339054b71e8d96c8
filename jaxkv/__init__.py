"""jaxkv: long-context LLM serving where the KV head is the unit of cache management."""

__version__ = "0.1.0"

__all__ = ["load", "generate", "SamplingParams", "__version__"]


def __getattr__(name):
    # Lazy so `import jaxkv` stays cheap for host-only users (scheduler, CLI argument parsing).
    if name == "load":
        from jaxkv.loading import load

        return load
    if name == "generate":
        from jaxkv.generation import generate

        return generate
    if name == "SamplingParams":
        from jaxkv.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'jaxkv' has no attribute {name!r}")
