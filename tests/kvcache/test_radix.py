"""RadixCache on its own: matching, locking, duplicates, LRU eviction, block hashes."""

from __future__ import annotations

import pytest

from runtime.kvcache.radix import (
    REMOVED,
    ROOT_HASH,
    STORED,
    RadixCache,
    block_hash,
    block_hashes,
)

PS = 4


def tokens(*pages: int) -> list[int]:
    """Full pages of tokens; page k holds k*10 .. k*10+3."""
    return [k * 10 + i for k in pages for i in range(PS)]


def test_only_full_pages_match_and_the_longest_prefix_wins() -> None:
    cache = RadixCache(PS)
    cache.insert(tokens(1, 2, 3), [7, 8, 9])
    assert cache.match([*tokens(1, 2, 3), 5])[0] == [7, 8, 9]
    assert cache.match([*tokens(1), 20, 21, 22, 99])[0] == [7]  # its second page differs
    assert cache.match(tokens(1, 2, 3)[:-1])[0] == [7, 8]  # the third page is not full
    assert cache.match(tokens(2))[0] == []
    assert cache.cached_pages == cache.evictable_pages == 3


def test_duplicates_are_handed_back_and_a_branch_shares_its_stem() -> None:
    cache = RadixCache(PS)
    cache.insert(tokens(1, 2), [7, 8])
    _, dups = cache.insert(tokens(1, 2, 3), [17, 18, 19])  # same first two pages, elsewhere
    assert dups == [17, 18] and cache.match(tokens(1, 2, 3))[0] == [7, 8, 19]
    _, dups = cache.insert(tokens(1, 4), [7, 21])  # its own stem page: no duplicate
    assert dups == [] and sorted(cache.pages()) == [7, 8, 19, 21]
    node, dups = cache.insert(tokens(1, 2, 5), [7, 30, 31], stop_at_duplicate=True)
    assert dups == [] and node.page == 7, "stops before the page held elsewhere"


def test_locked_paths_survive_eviction_and_lru_leaves_go_first() -> None:
    cache = RadixCache(PS)
    cache.insert(tokens(1, 2), [1, 2])
    cache.insert(tokens(3, 4), [3, 4])
    cache.insert(tokens(5), [5])
    _, node = cache.match(tokens(1, 2))  # touched: the newest
    cache.lock(node)
    assert cache.evictable_pages == 3 and cache.cached_pages == 5  # 2 locked
    assert cache.evict(1) == [4]  # the oldest leaf (3, 4 before 5)
    assert cache.evict(10) == [3, 5]  # 3 became a leaf; the locked path stays
    assert cache.match(tokens(1, 2))[0] == [1, 2] and cache.evictable_pages == 0
    cache.unlock(node)
    assert sorted(cache.flush()) == [1, 2] and cache.cached_pages == 0
    with pytest.raises(RuntimeError, match="unlocked more often"):
        cache.unlock(node)


def test_a_parent_becomes_evictable_once_its_children_are_gone() -> None:
    cache = RadixCache(PS)
    cache.insert(tokens(1, 2, 3), [1, 2, 3])
    assert cache.evict(3) == [3, 2, 1]
    assert cache.stats.evicted_tokens == 3 * PS


def test_events_are_kept_only_for_a_follower() -> None:
    cache = RadixCache(PS)
    cache.insert(tokens(1), [1])
    assert cache.events is None and cache.take_events() == []  # the offline engine: none pile up
    cache.events = []
    node, _ = cache.insert(tokens(1, 2), [1, 2])
    cache.evict(1)
    assert cache.take_events() == [[STORED, node.hash], [REMOVED, node.hash]]
    assert cache.take_events() == []


def test_block_hashes_chain_over_the_prefix_and_match_the_nodes() -> None:
    cache = RadixCache(PS)
    node, _ = cache.insert(tokens(1, 2), [1, 2])
    assert block_hashes([*tokens(1, 2), 9], PS) == [node.parent.hash, node.hash]  # type: ignore[union-attr]
    assert block_hash(ROOT_HASH, tokens(2)) != block_hashes(tokens(1, 2), PS)[1]
    assert sorted(cache.hashes()) == sorted(block_hashes(tokens(1, 2), PS))


def test_salts_are_namespaces_with_hashes_of_their_own() -> None:
    """Requests share KV only within one cache salt; the hashes of a salt's pages are its own
    (what the KV events and the router's index see); an emptied salt keeps no root."""
    cache = RadixCache(PS)
    cache.events = []
    cache.insert(tokens(1, 2), [1, 2], salt="tenant-a")
    assert cache.match(tokens(1, 2), "tenant-a")[0] == [1, 2]
    assert cache.match(tokens(1, 2))[0] == [] and cache.match(tokens(1, 2), "tenant-b")[0] == []
    node, dups = cache.insert(tokens(1, 2), [3, 4], salt="tenant-b")  # not a duplicate of a's
    assert dups == [] and cache.match(tokens(1, 2), "tenant-b")[0] == [3, 4]
    a, b = block_hashes(tokens(1, 2), PS, "tenant-a"), block_hashes(tokens(1, 2), PS, "tenant-b")
    assert not set(a) & set(b) and not set(a) & set(block_hashes(tokens(1, 2), PS))
    assert [h for _, h in cache.take_events()] == [*a, *b]
    assert sorted(cache.hashes()) == sorted(a + b) and node.hash == b[-1]
    cache.lock(node)
    assert sorted(cache.evict(4)) == [1, 2]  # b's are locked; a's go, and a's root with them
    assert set(cache.roots) == {None, "tenant-b"}
    cache.unlock(node)
    assert sorted(cache.flush()) == [3, 4] and set(cache.roots) == {None}
    assert cache.cached_pages == cache.evictable_pages == 0
