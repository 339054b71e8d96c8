"""Per-(layer, KV head) paged KV cache.

Host modules (``allocator``, ``tables``, ``prefix``, ``head_classes``) are numpy-only; ``pool`` is the
device pytree and imports jax. Import submodules directly so host code never pulls in jax.
"""
