"""Automatic prefix caching by full-page token blocks (host, numpy, never imports jax).

Block ``b`` of a prompt is tokens ``[b * page_size, (b + 1) * page_size)``. Its key is a chain hash over
(parent block's hash, the block's token ids, ``extra_key``), so a block matches only when the whole prefix
before it and the namespace match. An entry holds the [L, H] page ids of that block for every (layer, KV
head) and one allocator reference to each.

Sharing is exact only when every head stores its full history in position order (all heads global): a
global head's pages for block ``b`` then hold exactly the K/V of those tokens at those positions, which
depend only on the prefix. The engine enables prefix caching only in that case.

Rules (as in nano-vllm): tokens are verified on a hit; the prompt's final token is never matched (at
least one token must be computed to produce logits); entries whose pages nobody else holds are evicted
least recently used first when the scheduler asks for pages.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from jaxkv.cache.allocator import PageAllocator


def block_hash(parent: bytes | None, tokens: Sequence[int], extra_key=None) -> bytes:
    """Chain hash of one token block."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(repr(extra_key).encode())
    h.update(b"|")
    h.update(np.asarray(tokens, np.int64).tobytes())
    return h.digest()


@dataclasses.dataclass
class _Entry:
    tokens: tuple[int, ...]
    pages: np.ndarray  # [L, H] int32


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        if page_size < 1:
            raise ValueError(f"PrefixCache: page_size must be >= 1 (got {page_size})")
        self.allocator = allocator
        self.page_size = page_size
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU first, most recent last
        self.queries = 0  # match() calls
        self.hits = 0  # match() calls that reused at least one block
        self.query_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # tokens served from the cache

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_pages(self) -> int:
        """Pages referenced by the cache (each counted once per entry)."""
        return sum(e.pages.size for e in self._entries.values())

    def _blocks(self, token_ids: Sequence[int], num_blocks: int, extra_key):
        parent = None
        ps = self.page_size
        for b in range(num_blocks):
            tokens = tuple(int(t) for t in token_ids[b * ps:(b + 1) * ps])
            parent = block_hash(parent, tokens, extra_key)
            yield parent, tokens

    def match(self, token_ids: Sequence[int], extra_key=None) -> tuple[int, list[np.ndarray]]:
        """Longest cached prefix of full blocks, never including the final token.

        Returns (num_cached_tokens, [L, H] page-id arrays per block). Takes no reference: the caller
        adopts the pages (``HeadPageTables.adopt_prefix`` increfs) before anything is evicted.
        """
        self.queries += 1
        self.query_tokens += len(token_ids)
        hits: list[bytes] = []
        for key, tokens in self._blocks(token_ids, max(len(token_ids) - 1, 0) // self.page_size, extra_key):
            entry = self._entries.get(key)
            if entry is None or entry.tokens != tokens:
                break
            hits.append(key)
        # Touch deepest first so a chain's parents stay more recent than its children: eviction then
        # removes leaves before the blocks they depend on.
        for key in reversed(hits):
            self._entries.move_to_end(key)
        if hits:
            self.hits += 1
            self.hit_tokens += len(hits) * self.page_size
        return len(hits) * self.page_size, [self._entries[k].pages.copy() for k in hits]

    def insert(self, token_ids: Sequence[int], blocks: Sequence[np.ndarray], extra_key=None) -> int:
        """Caches the full blocks of ``token_ids``; ``blocks[b]`` is block b's [L, H] page ids.

        Blocks already cached keep their existing pages. Returns the number of new entries.
        """
        num_blocks = min(len(blocks), len(token_ids) // self.page_size)
        added = 0
        keys = []
        for b, (key, tokens) in enumerate(self._blocks(token_ids, num_blocks, extra_key)):
            entry = self._entries.get(key)
            if entry is not None and entry.tokens != tokens:
                break  # hash collision: never alias different tokens
            if entry is None:
                pages = np.array(blocks[b], np.int32)
                self.allocator.incref(pages)
                self._entries[key] = _Entry(tokens, pages)
                added += 1
            keys.append(key)
        for key in reversed(keys):
            self._entries.move_to_end(key)
        return added

    def evict(self, num_pages: int) -> int:
        """Drops least recently used entries whose pages only the cache holds until ``num_pages`` pages
        are free again; returns the number of pages freed."""
        freed = 0
        for key in list(self._entries):
            if freed >= num_pages:
                break
            entry = self._entries[key]
            if (self.allocator.refcount(entry.pages) == 1).all():
                del self._entries[key]
                self.allocator.decref(entry.pages)
                freed += entry.pages.size
        return freed

    def clear(self) -> None:
        """Drops every entry and its references (pages held by sequences stay alive)."""
        for entry in self._entries.values():
            self.allocator.decref(entry.pages)
        self._entries.clear()
