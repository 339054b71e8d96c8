"""Compression methods; importing this package registers them."""

from jaxkv.policies.compress import adakv, h2o, hardkv, pyramidkv, rkv, snapkv, streaming_llm  # noqa: F401
