"""KV policies: one small module per method behind one interface (docs/policies.md).

`get_policy("snapkv", budget=0.125)` builds a method by name; `POLICIES` lists them. A method module
registers itself with `@register`; adding a method is one module plus its import in `compress/__init__.py`.
"""

from __future__ import annotations

from jaxkv.policies import compress as _compress  # noqa: E402,F401  (registers the methods)
from jaxkv.policies import retrieve as _retrieve  # noqa: E402,F401  (registers the retrieval methods)
from jaxkv.policies.base import CompressPolicy, Keep, Observation, SelectContext, select
from jaxkv.policies.registry import POLICIES, get_policy, register

__all__ = ["POLICIES", "CompressPolicy", "Keep", "Observation", "SelectContext", "get_policy", "register",
           "select"]
