"""Retrieval methods (select per head what decode attention reads, evict nothing); importing this package
registers them."""

from jaxkv.policies.retrieve import quest, specontext  # noqa: F401
from jaxkv.policies.retrieve.base import RetrievalPolicy, Selection, overlap, select

__all__ = ["RetrievalPolicy", "Selection", "overlap", "select"]
