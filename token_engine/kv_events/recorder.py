"""Turns the block manager's prefix-cache changes into vLLM KV events.

The block manager indexes blocks under its own hashes; routers index them under vLLM's (sha256 over the parent
hash, the block's token ids and extra keys, seeded as vLLM seeds it). The recorder keeps vLLM's digest of every
hashed block, chained from the block before it in the sequence's table, so a stored block costs one hash and a
removed one a dict lookup. It is only built when events are on: the block manager pays nothing otherwise.

Events follow vLLM's block pool: one ``BlockStored`` per run of blocks that entered the prefix index together
(parent = the hash of the block before the run), one ``BlockRemoved`` per block whose hash left the index on
eviction, ``AllBlocksCleared`` on a prefix-cache reset.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve_common.block_hashes import HASH_FUNCTIONS, BlockHashConfig, block_hashes, external_hash
from token_engine.kv_events.wire import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

if TYPE_CHECKING:
    from token_engine.core.sequence import Sequence


class KVEventRecorder:
    def __init__(self, hash_config: BlockHashConfig, medium: str = MEDIUM_GPU) -> None:
        self.hash_config = hash_config
        self.medium = medium
        self._fn = HASH_FUNCTIONS[hash_config.hash_algo]
        self._root = self._fn(hash_config.resolved_seed())
        self.digest: dict[int, bytes] = {}  # block id -> vLLM's hash of the block it holds
        self.pending: list[KVEvent] = []
        self.weight_epoch = 0  # the engine's; blocks of sequences begun under older weights are not published

    def take(self) -> list[KVEvent]:
        events, self.pending = self.pending, []
        return events

    def _parent_digest(self, seq: Sequence, index: int) -> bytes:
        if index == 0:
            return self._root
        known = self.digest.get(seq.block_table[index - 1])
        if known is not None:
            return known
        # The block before lost its hash (a reset while the sequence ran): rebuild the chain from its tokens.
        size = self.hash_config.block_size
        return block_hashes(seq.token_ids[:index * size], self.hash_config, cache_salt=seq.event_salt)[-1]

    def blocks_hashed(self, seq: Sequence, hashed: list[int], indexed: list[int]) -> None:
        """`hashed`: indices of seq's blocks that were just given a hash, in order; `indexed`: those of them whose
        hash entered the prefix index (an identical block already cached keeps the entry)."""
        if seq.weight_epoch != self.weight_epoch:
            return  # KV from weights the engine no longer has: never offered to a router
        size = self.hash_config.block_size
        salt = seq.event_salt
        for i in hashed:
            parent = self._parent_digest(seq, i)
            keys = (("cache_salt", salt),) if i == 0 and salt else None
            self.digest[seq.block_table[i]] = self._fn((parent, tuple(seq.token_ids[i * size:(i + 1) * size]), keys))
        run: list[int] = []
        for i in indexed:
            if run and i != run[-1] + 1:
                self._stored(seq, run)
                run = []
            run.append(i)
        if run:
            self._stored(seq, run)

    def _stored(self, seq: Sequence, run: list[int]) -> None:
        size = self.hash_config.block_size
        first = run[0]
        parent = external_hash(self._parent_digest(seq, first)) if first else None
        self.pending.append(BlockStored(
            block_hashes=[external_hash(self.digest[seq.block_table[i]]) for i in run],
            parent_block_hash=parent,
            token_ids=seq.token_ids[first * size:(run[-1] + 1) * size],
            block_size=size, lora_id=None, medium=self.medium, lora_name=None,
            # vLLM publishes each block's extra keys untagged: the salt on a salted first block, else None
            extra_keys=[(seq.event_salt,) if i == 0 and seq.event_salt else None for i in run],
            group_idx=0))

    def block_evicted(self, block_id: int, indexed: bool) -> int | None:
        """The evicted block's event hash (None if it had none)."""
        digest = self.digest.pop(block_id, None)
        if digest is None:
            return None
        if indexed:
            self.pending.append(BlockRemoved(block_hashes=[external_hash(digest)], medium=self.medium, group_idx=0))
        return external_hash(digest)

    # The host tier's moves, as vLLM's offloading connector reports them by default: the hash alone (its
    # placeholder store: no tokens, block size 0), medium CPU.
    def host_stored(self, event_hash: int) -> None:
        self.pending.append(BlockStored(block_hashes=[event_hash], parent_block_hash=None, token_ids=[], block_size=0,
                                        lora_id=None, medium=MEDIUM_CPU, lora_name=None, group_idx=0))

    def host_removed(self, event_hashes: list[int]) -> None:
        self.pending.append(BlockRemoved(block_hashes=list(event_hashes), medium=MEDIUM_CPU, group_idx=0))

    def cleared(self) -> None:
        self.digest.clear()
        self.pending.append(AllBlocksCleared())
