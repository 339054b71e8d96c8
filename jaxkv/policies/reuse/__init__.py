"""Segment-reuse methods: one module each behind `ReusePolicy` (docs/policies.md, "Reuse")."""

from __future__ import annotations

from jaxkv.policies.reuse import cacheblend, epic, full, naive, redknot, sparsex  # noqa: F401 (registers)
from jaxkv.policies.reuse.base import (
                                       REUSE_POLICIES,
                                       LayerView,
                                       Layout,
                                       ReusePolicy,
                                       get_reuse_policy,
                                       register_reuse,
                                       resolve_reuse,
)

__all__ = ["REUSE_POLICIES", "LayerView", "Layout", "ReusePolicy", "get_reuse_policy", "register_reuse",
           "resolve_reuse"]
