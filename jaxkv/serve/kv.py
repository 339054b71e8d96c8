"""KV compression policies and segment reuse as the server sees them (docs/serving.md, "KV policies" and
"Segment reuse").

Everything here runs on the event loop, never on the engine: it turns what a client (or the command line)
names into validated policy objects and turns what is wrong into a `RequestError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json

from jaxkv.serve.protocol import RequestError

DEFAULT = "default"  # a request that leaves `kv_policy` out: the server's policy applies


def compression_policies() -> list[str]:
    """Names of the registered compression policies (retrieval policies are not engine kv_policies)."""
    from jaxkv.policies import POLICIES, CompressPolicy

    return sorted(n for n, cls in POLICIES.items() if issubclass(cls, CompressPolicy))


def reuse_methods() -> list[str]:
    from jaxkv.policies.reuse import REUSE_POLICIES

    return sorted(REUSE_POLICIES)


def build_policy(name: str, fields: dict):
    """A compression policy by name with its fields (budget, window, ...); ValueError naming the problem."""
    from jaxkv.policies import get_policy

    if not isinstance(name, str) or name not in compression_policies():
        raise ValueError(f"unknown KV policy {name!r}; choose from {compression_policies()}")
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


def request_policy(req):
    """The request's `kv_policy`: DEFAULT (left out), None (`null`: the full cache) or a policy object.

    Accepted: ``"snapkv"`` (its default budget) or ``{"name": "snapkv", "budget": 0.25, ...fields}``.
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
                               f"{compression_policies()}), or null for the full cache.", "kv_policy")
    if name in ("full", "none"):
        if fields:
            raise RequestError(f"kv_policy {name!r} (the full cache) takes no fields.", "kv_policy")
        return None
    try:
        return build_policy(name, fields)
    except ValueError as e:
        raise RequestError(f"Invalid kv_policy: {e}.", "kv_policy") from None


def request_reuse_method(value):
    """The reuse method of a request: a name or {"name": ..., fields}; RequestError naming reuse.method."""
    from jaxkv.policies.reuse import get_reuse_policy

    if isinstance(value, str):
        name, fields = value, {}
    else:
        fields = dict(value)
        name = fields.pop("name", None)
    try:
        if not isinstance(name, str):
            raise ValueError(f"a method name is needed; choose from {reuse_methods()}")
        return get_reuse_policy(name, **fields)
    except (ValueError, TypeError) as e:
        raise RequestError(f"Invalid reuse method: {e}.", "reuse.method") from None


def segment_not_found(seg_id: str, param: str | None = None, status: int = 400) -> RequestError:
    # One message for unknown, deleted and other-namespace ids: which namespace an id lives in is a tenant's
    # business, not the caller's.
    return RequestError(f"Segment {seg_id!r} does not exist (unknown, deleted, or registered under another "
                        "API key or cache_salt).", param, "segment_not_found", status)
