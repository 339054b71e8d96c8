"""Pallas kernels for head-aware paged attention; each kernel folder carries its jnp reference twin."""
