"""RadixCache: KV pages kept after their request ends, found again by the token ids they hold.

A trie at page granularity. Each node is one full KV page: the `page_size` token ids whose KV
it holds, under the node of the tokens before them (the root is the empty prefix). The KV of a
position depends only on the tokens up to it, so a path from the root is a valid KV prefix for
every prompt that starts with those tokens, whoever computed it. Only full pages are shared: a
request's last, partial page stays its own, and nothing is ever written into a shared page
(a request that reuses k pages starts writing at position k * page_size, on a page of its own).

Ownership: a page is either free (the allocator's), a request's own, or the tree's. A request
that reuses a path *locks* its deepest node (a reference count on every node up to the root),
so nothing it reads can be evicted. Eviction takes unlocked leaves, least recently used first;
an unlocked node has no locked descendant, so every unlocked node can go, leaf by leaf.

Each node carries a block hash: blake2b chained over its parent's hash and its token ids (8
bytes), the name the KV events and the router's index use for it.

A request's `cache_salt` (vLLM's and sglang's field; the router sets one per API key) puts its
pages under a root of that salt's own, whose hash is the salt's: requests share KV only with
requests of the same salt, and block hashes are per salt too (KV events, the router's index), so
neither a cache hit, a prefill's speed nor a hash tells one tenant what another one sent.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from hashlib import blake2b

ROOT_HASH = 0
STORED, REMOVED = 1, 0  # KV event kinds


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The chained hash naming one full page of token ids after `parent`'s (signed int64)."""
    h = blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little", signed=True))
    for t in tokens:
        h.update(t.to_bytes(4, "little"))
    return int.from_bytes(h.digest(), "little", signed=True)


def root_hash(salt: str | None) -> int:
    """The hash the pages of requests with cache salt `salt` chain from (ROOT_HASH: none)."""
    if salt is None:
        return ROOT_HASH
    h = blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=8, person=b"baton-salt")
    return int.from_bytes(h.digest(), "little", signed=True)


def block_hashes(tokens: Sequence[int], page_size: int, salt: str | None = None) -> list[int]:
    """The hash of each full page of `tokens`, chained from the root of `salt`."""
    out, parent = [], root_hash(salt)
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = block_hash(parent, tokens[start:start + page_size])
        out.append(parent)
    return out


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]
    page: int
    parent: Node | None
    hash: int = ROOT_HASH
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    salt: str | None = None  # a root's: the cache salt of everything under it


@dataclass
class CacheStats:
    query_tokens: int = 0  # prompt tokens looked up at admission
    hit_tokens: int = 0  # of those, found cached
    evicted_tokens: int = 0


class RadixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = self._new_root(None)  # requests without a salt
        self.roots: dict[str | None, Node] = {None: self.root}  # one per salt in use
        self.cached_pages = 0  # nodes in the tree (root excluded)
        self.evictable_pages = 0  # of those, unlocked
        self.stats = CacheStats()
        # [1 stored | 0 removed, block hash] for take_events; None: nobody follows them (the
        # offline engine), so nothing piles up
        self.events: list[list[int]] | None = None
        self._clock = itertools.count(1)

    # ---- lookups ----------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], salt: str | None = None) -> tuple[list[int], Node]:
        """The pages of the longest cached prefix of `tokens` (full pages only) among the
        requests of `salt`, and its node (a root when there is none)."""
        node, pages, now = self.roots.get(salt, self.root), [], next(self._clock)
        ps = self.page_size
        for start in range(0, len(tokens) - ps + 1, ps):
            child = node.children.get(tuple(tokens[start:start + ps]))
            if child is None:
                break
            child.last_access = now
            pages.append(child.page)
            node = child
        return pages, node

    # ---- references -------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_pages -= 1
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        now = next(self._clock)
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref < 0:
                raise RuntimeError("radix cache: a node unlocked more often than locked")
            if node.lock_ref == 0:
                self.evictable_pages += 1
            node.last_access = now
            node = node.parent  # type: ignore[assignment]

    # ---- insertion --------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int], *, salt: str | None = None,
               stop_at_duplicate: bool = False) -> tuple[Node, list[int]]:
        """Put the full pages of `tokens`, held in `pages`, into the tree under `salt`'s root.

        Returns the deepest node reached and the duplicates: pages of `pages` whose tokens the
        tree already held in another page (the caller frees them). With `stop_at_duplicate` it
        stops before the first duplicate instead (the caller still reads those pages)."""
        if len(tokens) < self.page_size:
            return self.roots.get(salt, self.root), []
        node = self.roots.get(salt) or self.roots.setdefault(salt, self._new_root(salt))
        dups, now, ps = [], next(self._clock), self.page_size
        for i, start in enumerate(range(0, len(tokens) - ps + 1, ps)):
            key = tuple(tokens[start:start + ps])
            child = node.children.get(key)
            if child is None:
                child = Node(key=key, page=pages[i], parent=node, hash=block_hash(node.hash, key))
                node.children[key] = child
                self.cached_pages += 1
                self.evictable_pages += 1
                if self.events is not None:
                    self.events.append([STORED, child.hash])
            elif child.page != pages[i]:
                if stop_at_duplicate:
                    break
                dups.append(pages[i])
            child.last_access = now
            node = child
        return node, dups

    # ---- eviction ---------------------------------------------------------------------------
    def evict(self, num_pages: int) -> list[int]:
        """Remove up to `num_pages` unlocked pages, least recently used leaves first; returns
        the freed page indices (the caller gives them back to the allocator)."""
        if num_pages <= 0 or self.evictable_pages == 0:
            return []
        tick = itertools.count()  # ties broken by discovery order, never by comparing nodes
        heap = [(n.last_access, next(tick), n) for n in self._nodes()
                if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key]
            freed.append(leaf.page)
            if self.events is not None:
                self.events.append([REMOVED, leaf.hash])
            self.cached_pages -= 1
            self.evictable_pages -= 1
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(tick), parent))
            elif parent.parent is None and parent.salt is not None and not parent.children:
                del self.roots[parent.salt]  # a salt with nothing cached keeps no root
        self.stats.evicted_tokens += len(freed) * self.page_size
        return freed

    def flush(self) -> list[int]:
        """Evict every unlocked page."""
        return self.evict(self.evictable_pages)

    def _nodes(self) -> list[Node]:
        out, stack = [], [n for root in self.roots.values() for n in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    @staticmethod
    def _new_root(salt: str | None) -> Node:
        root = Node(key=(), page=-1, parent=None, hash=root_hash(salt), salt=salt)
        root.lock_ref = 1  # never evicted
        return root

    def take_events(self) -> list[list[int]]:
        """What was stored and removed since the last call, in order."""
        out, self.events = self.events or [], []
        return out

    # ---- views ------------------------------------------------------------------------------
    def pages(self) -> list[int]:
        """Every page the tree holds."""
        return [n.page for n in self._nodes()]

    def hashes(self) -> list[int]:
        """The block hash of every cached page (the worker's KV events name blocks by these)."""
        return [n.hash for n in self._nodes()]
