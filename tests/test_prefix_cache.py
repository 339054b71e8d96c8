"""PrefixCache: chain hashing, token verification, namespaces, LRU eviction, refcounts."""

import numpy as np

from jaxkv.cache.allocator import PageAllocator
from jaxkv.cache.prefix import PrefixCache, block_hash
from jaxkv.cache.tables import HeadPageTables

PS = 4


def _setup(num_pages=64, L=2, H=2):
    alloc = PageAllocator(num_pages)
    z = np.zeros((L, H), np.int32)
    return alloc, HeadPageTables(L, H, PS, alloc, z, z, 16), PrefixCache(alloc, PS)


def _prefill_and_insert(tables, cache, seq_id, tokens, extra_key=None):
    """Prefill a sequence (adopting any cached prefix) and insert its full prompt blocks."""
    n_cached, blocks = cache.match(tokens, extra_key)
    if n_cached:
        tables.adopt_prefix(seq_id, blocks, n_cached)
    tables.append(seq_id, np.arange(n_cached, len(tokens)))
    lists = tables.page_lists(seq_id)
    nb = len(tokens) // PS
    blocks = [np.array([[lists[i][h][b] for h in range(len(lists[0]))] for i in range(len(lists))])
              for b in range(nb)]
    cache.insert(tokens[:nb * PS], blocks, extra_key)
    return n_cached


def test_block_hash_chains():
    a = block_hash(None, [1, 2, 3, 4])
    assert a == block_hash(None, [1, 2, 3, 4])
    assert a != block_hash(None, [1, 2, 3, 5])
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(block_hash(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert block_hash(None, [1, 2, 3, 4], "ns") != a


def test_match_reuses_full_blocks_never_last_token():
    alloc, tables, cache = _setup()
    prompt = list(range(100, 112))  # 3 full blocks
    assert _prefill_and_insert(tables, cache, "a", prompt) == 0
    assert len(cache) == 3 and cache.queries == 1 and cache.hits == 0
    # The same prompt: the final token must be computed, so only 2 blocks match.
    n, blocks = cache.match(prompt)
    assert n == 8 and len(blocks) == 2 and blocks[0].shape == (2, 2)
    np.testing.assert_array_equal(blocks[0], [[tables.page_lists("a")[i][h][0] for h in range(2)]
                                              for i in range(2)])
    # A longer prompt sharing the prefix reuses all 3 blocks; a diverging one only the shared blocks.
    assert cache.match(prompt + [7])[0] == 12
    assert cache.match(prompt[:6] + [0] * 10)[0] == 4
    assert cache.match([0] + prompt[1:] + [1])[0] == 0  # chain: block 0 differs, nothing matches
    assert cache.hits == 3 and cache.queries == 5 and cache.hit_tokens == 24
    # Sequence b adopts a's pages.
    assert _prefill_and_insert(tables, cache, "b", prompt + [1, 2, 3, 4, 5]) == 12
    assert len(cache) == 4
    shared = np.stack(cache.match(prompt + [9])[1])
    assert (alloc.refcount(shared) == 3).all()  # a, b and the cache


def test_namespace_isolation():
    alloc, tables, cache = _setup()
    prompt = list(range(9))
    _prefill_and_insert(tables, cache, "a", prompt, extra_key="tenant-1")
    assert cache.match(prompt, "tenant-1")[0] == 8
    assert cache.match(prompt, "tenant-2")[0] == 0
    assert cache.match(prompt)[0] == 0


def test_token_verification_on_hash_hit():
    alloc, tables, cache = _setup()
    prompt = list(range(9))
    _prefill_and_insert(tables, cache, "a", prompt)
    # Simulate a colliding entry: same key, different tokens -> treated as a miss.
    cache._entries[block_hash(None, prompt[:4])].tokens = (9, 9, 9, 9)
    assert cache.match(prompt)[0] == 0


def test_refcounts_and_lru_eviction():
    alloc, tables, cache = _setup(num_pages=64)
    p1, p2 = list(range(9)), list(range(50, 59))  # 2 blocks each, 4 pages per block
    _prefill_and_insert(tables, cache, "a", p1)
    _prefill_and_insert(tables, cache, "b", p2)
    assert cache.num_pages == 16
    # While sequences hold the pages nothing can be evicted.
    assert cache.evict(100) == 0
    tables.release("a")
    tables.release("b")
    free = alloc.num_free
    assert free == 64 - 16  # cached pages stay alive after the sequences finish
    cache.match(p1 + [1])  # p1 becomes most recent
    # LRU: p2's blocks go first, leaf (block 1) before its parent (block 0).
    b0 = block_hash(None, p2[:4])
    assert list(cache._entries)[:2] == [block_hash(b0, p2[4:8]), b0]
    assert cache.evict(4) == 4  # one block entry = L * H pages
    # b's block 0 is touched, then a's chain: b0 is now the least recently used entry.
    assert cache.match(p2 + [1])[0] == 4 and cache.match(p1 + [1])[0] == 8
    assert cache.evict(1) == 4
    assert cache.match(p2 + [1])[0] == 0 and cache.match(p1 + [1])[0] == 8
    assert alloc.num_free == free + 8
    cache.clear()
    assert alloc.num_free == 64 and len(cache) == 0


def test_evict_skips_entries_in_use():
    alloc, tables, cache = _setup(num_pages=64)
    _prefill_and_insert(tables, cache, "a", list(range(9)))
    _prefill_and_insert(tables, cache, "b", list(range(20, 29)))
    tables.release("a")  # a's entries become evictable; b's are still held
    assert cache.evict(1000) == 8
    assert len(cache) == 2 and cache.match(list(range(20, 29)))[0] == 8
