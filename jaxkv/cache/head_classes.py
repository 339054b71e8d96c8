"""Per-(layer, KV head) head classes: data, not code (numpy only, never imports jax).

A ``HeadClassMap`` says how each KV head uses its cache: ``global`` (full history), ``local(sink,
window)`` (sink tokens plus a recent window, stored as a bounded ring), ``budget(lower, upper)`` (a
compressed head keeping between ``lower`` and ``upper`` tokens) and ``retrieval`` (a head that attends
over the whole context through retrieval). Storage-wise only ``local`` differs from ``global`` here;
budget and retrieval heads keep full history until a policy compacts them.

File format (``head_classes.json`` next to a model; a missing file means all global)::

    {"format": "jaxkv.head_classes/v1", "num_layers": 2, "num_kv_heads": 2,
     "heads": [[{"kind": "global"}, {"kind": "local", "sink": 64, "window": 256}],
               [{"kind": "budget", "lower": 128, "upper": 1024}, {"kind": "retrieval"}]]}
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

import numpy as np

FORMAT = "jaxkv.head_classes/v1"
KINDS = ("global", "local", "budget", "retrieval")
_FIELDS = {"global": (), "local": ("sink", "window"), "budget": ("lower", "upper"), "retrieval": ()}


def _nonneg_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ValueError(f"head class: {name} must be a non-negative integer (got {value!r})")
    return int(value)


@dataclasses.dataclass(frozen=True)
class HeadClass:
    """One KV head's class. Fields that do not apply to ``kind`` must stay 0."""

    kind: str = "global"
    sink: int = 0  # local: always-visible first positions
    window: int = 0  # local: a query at p sees keys k with p - window < k <= p; must be >= 1
    lower: int = 0  # budget: minimum tokens kept
    upper: int = 0  # budget: maximum tokens kept; >= max(lower, 1)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"head class: unknown kind {self.kind!r}; expected one of {KINDS}")
        for name in ("sink", "window", "lower", "upper"):
            _nonneg_int(getattr(self, name), name)
            if name not in _FIELDS[self.kind] and getattr(self, name) != 0:
                raise ValueError(f"head class: field {name!r} does not apply to kind {self.kind!r}")
        if self.kind == "local" and self.window < 1:
            raise ValueError(f"head class: a local head needs window >= 1 (got {self.window})")
        if self.kind == "budget" and not (self.upper >= 1 and self.upper >= self.lower):
            raise ValueError(f"head class: budget needs 0 <= lower <= upper and upper >= 1 "
                             f"(got lower={self.lower}, upper={self.upper})")

    @classmethod
    def global_(cls) -> HeadClass:
        return cls("global")

    @classmethod
    def local(cls, sink: int, window: int) -> HeadClass:
        return cls("local", sink=sink, window=window)

    @classmethod
    def budget(cls, lower: int, upper: int) -> HeadClass:
        return cls("budget", lower=lower, upper=upper)

    @classmethod
    def retrieval(cls) -> HeadClass:
        return cls("retrieval")

    def to_json(self) -> dict:
        return {"kind": self.kind, **{f: getattr(self, f) for f in _FIELDS[self.kind]}}

    @classmethod
    def from_json(cls, obj) -> HeadClass:
        if not isinstance(obj, dict) or "kind" not in obj:
            raise ValueError(f"head class: expected an object with a 'kind' (got {obj!r})")
        kind = obj["kind"]
        if kind not in KINDS:
            raise ValueError(f"head class: unknown kind {kind!r}; expected one of {KINDS}")
        extra = set(obj) - {"kind", *_FIELDS[kind]}
        missing = set(_FIELDS[kind]) - set(obj)
        if extra or missing:
            raise ValueError(f"head class {kind!r}: expected fields {list(_FIELDS[kind])}, "
                             f"unexpected {sorted(extra)}, missing {sorted(missing)}")
        return cls(kind, **{f: obj[f] for f in _FIELDS[kind]})


@dataclasses.dataclass(frozen=True)
class HeadClassMap:
    """Classes of every (layer, KV head): ``classes[layer][kv_head]``."""

    num_layers: int
    num_kv_heads: int
    classes: tuple[tuple[HeadClass, ...], ...]

    def __post_init__(self):
        if self.num_layers < 1 or self.num_kv_heads < 1:
            raise ValueError(f"head classes: num_layers and num_kv_heads must be >= 1 "
                             f"(got {self.num_layers}, {self.num_kv_heads})")
        rows = tuple(tuple(r) for r in self.classes)
        if len(rows) != self.num_layers or any(len(r) != self.num_kv_heads for r in rows):
            raise ValueError(f"head classes: 'heads' must be {self.num_layers} layers x {self.num_kv_heads} "
                             f"kv heads (got {[len(r) for r in rows]})")
        if not all(isinstance(c, HeadClass) for r in rows for c in r):
            raise ValueError("head classes: every entry must be a HeadClass")
        object.__setattr__(self, "classes", rows)

    def __getitem__(self, index: tuple[int, int]) -> HeadClass:
        layer, head = index
        return self.classes[layer][head]

    def kinds(self) -> np.ndarray:
        """[L, H] array of kind strings."""
        return np.array([[c.kind for c in row] for row in self.classes])

    def counts(self) -> dict[str, int]:
        """Number of (layer, kv head) pairs of each kind (every kind present as a key)."""
        out = dict.fromkeys(KINDS, 0)
        for row in self.classes:
            for c in row:
                out[c.kind] += 1
        return out

    def sink_window_arrays(self, layer_windows: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Effective per-head (sink [L, H] int32, window [L, H] int32).

        ``layer_windows`` is the model's own per-layer window (0 = full attention), e.g. Mistral's
        ``sliding_window``. The smaller non-zero window of the layer and a local class wins; sinks come
        from the head class only.
        """
        L, H = self.num_layers, self.num_kv_heads
        if layer_windows is None:
            layer_windows = (0,) * L
        layer_windows = tuple(layer_windows)
        if len(layer_windows) != L:
            raise ValueError(f"layer_windows has {len(layer_windows)} entries; the map has {L} layers")
        sink = np.zeros((L, H), np.int32)
        window = np.zeros((L, H), np.int32)
        for layer, row in enumerate(self.classes):
            lw = _nonneg_int(layer_windows[layer], f"layer_windows[{layer}]")
            for h, c in enumerate(row):
                w = lw
                if c.kind == "local":
                    w = c.window if lw == 0 else min(lw, c.window)
                    sink[layer, h] = c.sink
                window[layer, h] = w
        return sink, window

    def to_json(self) -> dict:
        return {"format": FORMAT, "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "heads": [[c.to_json() for c in row] for row in self.classes]}

    @classmethod
    def from_json(cls, obj) -> HeadClassMap:
        if not isinstance(obj, dict):
            raise ValueError("head classes: the file must hold a JSON object")
        if obj.get("format") != FORMAT:
            raise ValueError(f"head classes: format must be {FORMAT!r} (got {obj.get('format')!r})")
        for key in ("num_layers", "num_kv_heads", "heads"):
            if key not in obj:
                raise ValueError(f"head classes: missing key {key!r}")
        L, H = obj["num_layers"], obj["num_kv_heads"]
        for name, v in (("num_layers", L), ("num_kv_heads", H)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"head classes: {name} must be a positive integer (got {v!r})")
        heads = obj["heads"]
        if not isinstance(heads, list) or len(heads) != L or any(
                not isinstance(r, list) or len(r) != H for r in heads):
            raise ValueError(f"head classes: 'heads' must be a list of {L} lists of {H} entries")
        return cls(L, H, tuple(tuple(HeadClass.from_json(c) for c in row) for row in heads))

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> HeadClassMap:
        with open(path) as f:
            try:
                obj = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"head classes: {path} is not valid JSON: {e}") from None
        return cls.from_json(obj)


def all_global(num_layers: int, num_kv_heads: int) -> HeadClassMap:
    """The default map: every head keeps its full history."""
    g = HeadClass.global_()
    return HeadClassMap(num_layers, num_kv_heads, tuple((g,) * num_kv_heads for _ in range(num_layers)))


def load_or_default(model_dir: str | os.PathLike, num_layers: int, num_kv_heads: int) -> HeadClassMap:
    """``model_dir/head_classes.json`` if present (shape-checked), else all global."""
    path = os.path.join(model_dir, "head_classes.json")
    if not os.path.exists(path):
        return all_global(num_layers, num_kv_heads)
    hc = HeadClassMap.load(path)
    if (hc.num_layers, hc.num_kv_heads) != (num_layers, num_kv_heads):
        raise ValueError(f"{path} is for {hc.num_layers} layers x {hc.num_kv_heads} kv heads; the model has "
                         f"{num_layers} x {num_kv_heads}")
    return hc
