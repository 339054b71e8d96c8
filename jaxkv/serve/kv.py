"""KV compression policies and segment reuse as the server sees them (docs/serving.md, "KV policies" and
"Segment reuse").

Everything here runs on the event loop, never on the engine: it turns what a client (or the command line)
names into validated policy objects and turns what is wrong into a `RequestError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math

from jaxkv.serve.engine_loop import DEFAULT_POLICY as DEFAULT  # `kv_policy` left out: the server's
from jaxkv.serve.protocol import RequestError


def kv_policies() -> list[str]:
    """Names of the registered KV policies: compression (rewrite the cache; budget = fraction of the prompt
    or tokens) and retrieval (keep it, decode reads a per-head top-B; budget = tokens per KV head)."""
    from jaxkv.policies import POLICIES

    return sorted(POLICIES)


def reuse_methods() -> list[str]:
    from jaxkv.policies.reuse import REUSE_POLICIES

    return sorted(REUSE_POLICIES)


def check_field_types(cls, fields: dict, what: str) -> None:
    """Every given field must have its default's type (an int where the default is an int, a number where it
    is a float, ...): policies are static arguments of jitted passes, so a list, dict or stray type that a
    method's own checks let through would fail inside the engine, not here. Fields whose default is None
    (internal state such as HARD-KV's loaded calibration) cannot be set."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for key, value in fields.items():
        if key not in defaults:
            continue  # the registry names unknown fields
        d = defaults[key]
        if isinstance(d, bool):
            ok = isinstance(value, bool)
        elif isinstance(d, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(d, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        elif isinstance(d, str):
            ok = isinstance(value, str)
        else:
            raise ValueError(f"{what}: field {key!r} cannot be set here")
        if not ok:
            kind = {bool: "a boolean", int: "an integer", float: "a finite number", str: "a string"}[type(d)]
            raise ValueError(f"{what}: {key} must be {kind} (default {d!r}; got {value!r})")


def build_policy(name: str, fields: dict):
    """A KV policy by name with its fields (budget, window, ...); ValueError naming the problem."""
    from jaxkv.policies import POLICIES, get_policy

    if not isinstance(name, str) or name not in kv_policies():
        raise ValueError(f"unknown KV policy {name!r}; choose from {kv_policies()}")
    check_field_types(POLICIES[name], fields, name)
    try:
        return get_policy(name, **fields)
    except TypeError as e:  # a field of the wrong kind that the dataclass itself rejects
        raise ValueError(f"KV policy {name!r}: {e}") from None


def parse_policy_args(items: list[str]) -> dict:
    """``["window=32", "pooling=max"]`` -> {"window": 32, "pooling": "max"} (JSON values, else strings)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--kv-policy-arg {item!r} is not KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def describe(policy) -> dict | None:
    """A policy as JSON (name + its plain fields), or None for the full cache."""
    if policy is None:
        return None
    out = {"name": policy.name}
    for f in dataclasses.fields(policy):
        v = getattr(policy, f.name)
        if v is None or isinstance(v, (bool, int, float, str)):
            out[f.name] = v
    return out


def _bounded(obj, limit: int, param: str):
    """Integer fields (window, sink, kernel, block, ...) size host and device buffers: a client may not set
    one beyond the context (`limit` = max_model_len). Budgets (floats) need no bound."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if type(f.default) is int and isinstance(v, int) and abs(v) > limit:
            raise RequestError(f"{param}: {f.name} must be at most max_model_len ({limit}) (got {v}).", param)
    return obj


def request_policy(req, limit: int, merge_ok: bool = True):
    """The request's `kv_policy`: DEFAULT (left out), None (`null`: the full cache) or a policy object.

    Accepted: ``"snapkv"`` (its default budget) or ``{"name": "snapkv", "budget": 0.25, ...fields}``.
    `merge_ok`: the engine's pool has the per-slot bias that a merging policy (HARD-KV's default) needs.
    """
    if "kv_policy" not in req.model_fields_set:
        return DEFAULT
    value = req.kv_policy
    if value is None:
        return None
    if isinstance(value, str):
        name, fields = value, {}
    else:
        fields = dict(value)
        name = fields.pop("name", None)
        if name is None:
            raise RequestError("kv_policy needs a 'name' (one of "
                               f"{kv_policies()}), or null for the full cache.", "kv_policy")
    if name in ("full", "none"):
        if fields:
            raise RequestError(f"kv_policy {name!r} (the full cache) takes no fields.", "kv_policy")
        return None
    try:
        policy = build_policy(name, fields)
    except ValueError as e:
        raise RequestError(f"Invalid kv_policy: {e}.", "kv_policy") from None
    if getattr(policy, "merge", False) and not merge_ok:
        raise RequestError(f"kv_policy {name!r} merges evicted tokens (merge=true), which needs a server "
                           "started with --kv-merge; send \"merge\": false to run it without merging.",
                           "kv_policy")
    return _bounded(policy, limit, "kv_policy")


def request_reuse_method(value, limit: int):
    """The reuse method of a request: a name or {"name": ..., fields}; RequestError naming reuse.method."""
    from jaxkv.policies.reuse import REUSE_POLICIES, get_reuse_policy

    if isinstance(value, str):
        name, fields = value, {}
    else:
        fields = dict(value)
        name = fields.pop("name", None)
    try:
        if not isinstance(name, str):
            raise ValueError(f"a method name is needed; choose from {reuse_methods()}")
        if name in REUSE_POLICIES:
            check_field_types(REUSE_POLICIES[name], fields, name)
        method = get_reuse_policy(name, **fields)
    except (ValueError, TypeError) as e:
        raise RequestError(f"Invalid reuse method: {e}.", "reuse.method") from None
    return _bounded(method, limit, "reuse.method")


def segment_not_found(seg_id: str, param: str | None = None, status: int = 400) -> RequestError:
    # One message for unknown, deleted and other-namespace ids: which namespace an id lives in is a tenant's
    # business, not the caller's.
    return RequestError(f"Segment {seg_id!r} does not exist (unknown, deleted, or registered under another "
                        "API key or cache_salt).", param, "segment_not_found", status)


def segment_card(tiers, e) -> dict:
    """A segment as /v1/segments shows it: its tiers (fastest first) and the bytes of K/V + positions it
    holds in each (docs/segments.md)."""
    ffn = 0 if e.ffn is None else e.ffn.nbytes
    return {"id": e.segment_id, "object": "segment", "num_tokens": e.length, "frozen": e.frozen,
            "tier_pin": tiers.pins.get(e.segment_id), "tiers": tiers.tiers(e), "bytes": tiers.tier_bytes(e),
            "in_use": e.refcount, "hits": e.hits, "ffn_cache_bytes": ffn, "context_tokens": len(e.context)}
