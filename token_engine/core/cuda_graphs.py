"""CUDA graphs for decode steps: one graph per padded batch size, replayed with the step's inputs copied in.

A decode step launches a few hundred small kernels; at small batch their launch gaps, not the GPU, set the
step time. Capturing the whole forward once per batch size and replaying it removes the gaps.

Use (model runner):

    graphs = DecodeGraphs(model, kv_pool, block_size, max_num_seqs=256, max_blocks_per_seq=max_model_len // bs)
    graphs.capture()
    if graphs.can_replay(meta):
        hidden = graphs.replay(input_ids, positions, meta)    # view of a static buffer: use before next replay
    else:
        hidden = model(input_ids, positions, meta, kv_pool)

Padded rows get slot -1 (their K/V is not written) and seq_len 1 (they read one slot of whatever block their
stale table row names, and their output is dropped). The pool must not be reallocated after capture.
"""

from __future__ import annotations

from typing import Any

import torch

from token_engine.layers.attention import AttentionMetadata


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_pool: torch.Tensor,
        block_size: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        batch_sizes: list[int] | None = None,
    ):
        self.model = model
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.batch_sizes = sorted(batch_sizes or default_batch_sizes(max_num_seqs))
        max_bs = self.batch_sizes[-1]
        device = kv_pool.device
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.memory_pool: Any = None  # torch's graph pool handle, shared by every captured size

    def _static_meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=self.max_blocks_per_seq * self.block_size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every batch size, largest first so the smaller graphs reuse its memory pool."""
        for bs in reversed(self.batch_sizes):
            meta = self._static_meta(bs)
            args = (self.input_ids[:bs], self.positions[:bs], meta, self.kv_pool)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up off the capture: compiles kernels, creates handles
                for _ in range(2):
                    self.model(*args)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.memory_pool):
                self.outputs[bs] = self.model(*args)
            if self.memory_pool is None:
                self.memory_pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def padded_size(self, num_seqs: int) -> int | None:
        for bs in self.batch_sizes:
            if bs >= num_seqs:
                return bs
        return None

    def can_replay(self, meta: AttentionMetadata) -> bool:
        """True for a decode-only step that fits a captured size and the captured block-table width."""
        return (
            bool(self.graphs)
            and meta.max_query_len == 1
            and meta.block_size == self.block_size
            and int(meta.block_tables.shape[1]) <= self.max_blocks_per_seq
            and self.padded_size(int(meta.seq_lens.shape[0])) is not None
        )

    @torch.inference_mode()
    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = int(input_ids.shape[0])
        bs = self.padded_size(n)
        if bs is None or bs not in self.graphs:
            raise ValueError(f"no captured decode graph for {n} sequences")
        width = int(meta.block_tables.shape[1])
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[n:bs].fill_(1)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
