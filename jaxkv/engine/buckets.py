"""Static-shape buckets: a ragged step compiles once per (tokens, page-table width) bucket, a multi-step
decode once per (sequences, page-table width) bucket."""

from __future__ import annotations


def powers_of_two(limit: int, start: int = 1, factor: int = 2) -> tuple[int, ...]:
    """start, factor*start, ... up to the first value >= limit (inclusive of limit itself)."""
    out, b = [], max(1, start)
    while b < limit:
        out.append(b)
        b *= factor
    out.append(max(limit, 1))
    return tuple(sorted(set(out)))


def pow2_bucket(n: int, lo: int = 128) -> int:
    """The smallest ``lo * 2**k >= n``: one compilation per doubling of a length (the eval's dense paths)."""
    b = lo
    while b < n:
        b *= 2
    return b


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
