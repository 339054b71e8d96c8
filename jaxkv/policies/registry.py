"""Name -> policy class, with clear errors for unknown names and bad fields."""

from __future__ import annotations

import dataclasses

POLICIES: dict[str, type] = {}


def register(cls):
    if cls.name in POLICIES:
        raise ValueError(f"policy {cls.name!r} is registered twice")
    POLICIES[cls.name] = cls
    return cls


def get_policy(name: str, **fields):
    """Builds the policy `name` with `fields` (budget, window, sink, ... as the method declares)."""
    if name not in POLICIES:
        raise ValueError(f"unknown KV policy {name!r}; choose from {sorted(POLICIES)}")
    cls = POLICIES[name]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"KV policy {name!r} has no field(s) {unknown}; fields: {sorted(known)}")
    return cls(**fields)
