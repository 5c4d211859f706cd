"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts, prefix caching by chained block keys.

A full block's key is ``sha256(parent key + its token ids)``, so it names the whole prefix up to the
block's end (as vLLM keys its cache since GHSA-rm76-4mrf-v9r8; Python's ``hash`` is 64 bits, unseeded for
ints and tuples, and collisions can be crafted). A hit is moreover checked exactly: the cached block must
hold the same tokens *and* the same parent key as the chain being matched, so even a colliding digest
never returns KV computed for another prefix.

A block with ref count 0 is *free* even when it still holds a cached prefix: it sits in an LRU list
and is either re-used by a prefix hit (ref count goes back to 1) or evicted when a new block is
needed (oldest first). Hence ``num_free + num_used == num_blocks`` always holds."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from reference_server.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # key of the prefix this block ends (None: not in the cache)
    parent: bytes = b""  # key of the prefix before it (b"" for a first block)
    token_ids: tuple[int, ...] = ()


def chain_hash(prev: bytes, token_ids: tuple[int, ...]) -> bytes:
    """Key of the prefix ``prev`` + ``token_ids``: sha256 over the parent key and the tokens as int64."""
    return hashlib.sha256(prev + array("q", token_ids).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # prefix key -> block id
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that ``seq`` can hold ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # -- prefix cache ---------------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks covering a prefix of ``seq`` (never its last token, which must be computed)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        prev = b""
        for i in range((seq.num_tokens - 1) // bs):
            toks = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(prev, toks)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != toks or self.blocks[bid].parent != prev:
                break
            hits.append(bid)
            prev = h
        return hits

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (``POST /reset_prefix_cache``): later prompts find no hits. Blocks in
        use keep their KV and their sequences; only the index that would hand them to another prompt goes."""
        self.cached.clear()
        for bid in self.free:
            block = self.blocks[bid]
            block.hash, block.parent, block.token_ids = None, b"", ()

    def can_admit(self, seq: Sequence, hits: list[int], num_tokens: int) -> bool:
        """Whether ``seq`` can start with ``hits`` and room for ``num_tokens`` tokens in total."""
        reused_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        new = max(0, -(-num_tokens // self.block_size) - len(hits))
        return new + reused_free <= len(self.free)

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Take the prefix-hit blocks; sets ``num_computed_tokens`` to the cached length."""
        assert not seq.block_table
        for bid in hits:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free[bid]
            block.ref_count += 1
            seq.block_table.append(bid)
            assert block.hash is not None
            seq.block_hashes.append(block.hash)
        cached = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += cached
        seq.num_computed_tokens = cached
        seq.num_cached_tokens = cached

    # -- allocation -----------------------------------------------------------------------------------
    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` enough blocks to hold ``num_tokens`` tokens (LRU-evicting cached free blocks)."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            bid, _ = self.free.popitem(last=False)
            block = self.blocks[bid]
            if block.hash is not None and self.cached.get(block.hash) == bid:
                del self.cached[block.hash]
            block.hash, block.parent, block.token_ids, block.ref_count = None, b"", (), 1
            seq.block_table.append(bid)

    def commit(self, seq: Sequence) -> None:
        """Publish blocks that became full of computed tokens to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        while len(seq.block_hashes) < seq.num_computed_tokens // bs:
            i = len(seq.block_hashes)
            toks = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            prev = seq.block_hashes[-1] if seq.block_hashes else b""
            h = chain_hash(prev, toks)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.parent, block.token_ids = h, prev, toks
                self.cached.setdefault(h, block.block_id)

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks reaching 0 become free (tail blocks are evicted first)."""
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[bid] = None
        seq.block_table = []
        seq.block_hashes = []
