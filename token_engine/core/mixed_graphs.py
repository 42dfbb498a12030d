"""CUDA graphs for mixed steps (prefill chunks next to decode tokens), replayed at padded token counts.

A step that mixes prefill chunks with decode tokens used to run the model eagerly. On a 7B model that is
~30 ms of launch gaps per step (an H200 with 32 decode streams and a ~75-token chunk took 39 ms a step, where
the graphed decode step takes 9 ms): the step budget, which keeps chunks small so that decode streams keep
their pace, then buys little prefill per step. Capturing the forward once per (token bucket, decode bucket)
and replaying it removes the gaps.

What makes such a step capturable:
- its tokens are padded up to a bucket; padded rows have slot -1 (no K/V written) and belong to no sequence;
- attention's per-step plan (which sequences decode, the prefill query tiles) is built on the host and copied
  into fixed-size device buffers; unused entries name a dummy sequence with nothing to attend to (context 0,
  no new tokens), so the fixed grids' extra programs do no work; with FlashAttention-3 for prefill
  (attention_cuda.PREFILL_FA3) the plan is each sequence's new-token count in a buffer (0 for decodes and
  unused entries) and the bucket's token count and the longest context as upper bounds;
- the dummy sequence's one row is the bucket's last padded row, so a step fills a bucket only up to its last
  row but one.
Steps with more than MAX_PREFILL_SEQS prefilling sequences, more decodes than the largest decode bucket or
wider block tables than captured run eagerly, as before. `verify` proves at start-up that a replay equals the
eager forward on a real mixed step; the runner drops the graphs when it does not.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from token_engine.layers.attention import AttentionMetadata, build_metadata
from token_engine.layers.attention_prefill_cuda import prefill_config, prefill_splits, prefill_tiles

log = logging.getLogger(__name__)

# Token counts a mixed step is padded to; past a few thousand tokens launch gaps are a few percent of a step.
# Steps of 1.5x between them: the step budget fills a step up to the largest bucket within its time target, and
# with doublings only a step lost a quarter of its room on average.
TOKEN_BUCKETS = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
# Numbers of decoding sequences a graph's decode grid covers (0: a step with prefill only). The decode kernel's
# context split is chosen for the bucket's size, as it would be for that many sequences.
DECODE_BUCKETS = (0, 8, 32, 128, 256)
MAX_PREFILL_SEQS = 4
# Past this bucket a step is graphed only when padding adds at most an eighth: an eager step of a thousand or
# more tokens keeps the GPU busy while the host launches ahead, and padding costs compute (a 1617-token agent
# turn padded to 2048 took 10% longer than eager on an H200).
ALWAYS_GRAPHED_TOKENS = 512
# bf16 over ~30 layers of random weights: a replay and the eager step pick matmul kernels for different row
# counts (0.026 seen on an H200 for a 7B shape); a wrong plan or stale buffer is off by the whole output.
VERIFY_TOLERANCE = 0.1


class MixedStepLayout:
    """The fixed-size device buffers a mixed-step graph reads, and how one step is written into them."""

    def __init__(self, device: torch.device, block_size: int, num_heads: int, head_dim: int, max_num_seqs: int,
                 max_blocks_per_seq: int, max_num_batched_tokens: int, fa3: bool = False):
        self.block_size = block_size
        # prefill chunks through FlashAttention-3 (attention_cuda.PREFILL_FA3), with every length an upper bound
        # fixed per bucket and each sequence's new-token count (0: a decode or unused entry) in a buffer
        self.fa3 = fa3
        self.num_heads = num_heads
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_m, self.block_n = prefill_config(head_dim)[:2]
        # No bucket past the step's token budget: a full step is compute-bound, padding it would cost more
        # than its launch gaps.
        self.token_buckets = [t for t in TOKEN_BUCKETS if t <= max(max_num_batched_tokens, TOKEN_BUCKETS[0])]
        self.decode_buckets = sorted({min(d, max_num_seqs) for d in DECODE_BUCKETS})
        self.max_num_seqs = max_num_seqs
        # The dummy's index is past query_start_loc's last real entry (index max_num_seqs at most).
        self.dummy = max_num_seqs + 1
        max_t = self.token_buckets[-1]
        seqs = max_num_seqs + 2
        self.input_ids = torch.zeros(max_t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_t, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_t,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.decode_ids = torch.full((self.decode_buckets[-1],), self.dummy, dtype=torch.int32, device=device)
        self.tiles = torch.zeros(2, self.max_tiles(max_t), dtype=torch.int32, device=device)
        self.prefill_lens = torch.zeros(seqs, dtype=torch.int32, device=device)

    def max_tiles(self, tokens: int) -> int:
        return -(-tokens // self.block_m) + MAX_PREFILL_SEQS

    def static_meta(self, key: tuple[int, int]) -> AttentionMetadata:
        """The metadata a graph of this key is captured with: views of the buffers, the plan precomputed."""
        tokens, decodes = key
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens], query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens, block_tables=self.block_tables, block_size=self.block_size,
            max_query_len=tokens, max_seq_len=self.max_blocks_per_seq * self.block_size)
        meta.backend_state["cuda_plan"] = {
            "decode_ids": self.decode_ids[:decodes] if decodes else None,
            "tiles": self.tiles[:, : self.max_tiles(tokens)],
            "fresh": [],
            # context slices for the tiles real tokens can fill, not the dummies that pad the grid
            "splits": prefill_splits(-(-tokens // self.block_m), self.num_heads, meta.max_seq_len, self.block_n),
            "fa3": None,
        }
        if self.fa3:
            meta.backend_state["cuda_plan"].update(tiles=None, fa3=(self.prefill_lens, tokens, meta.max_seq_len))
        return meta

    def fill(self, tokens: int, input_ids: list[int], positions: list[int], slots: torch.Tensor,
             query_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor,
             sample_rows: Sequence[int] = ()) -> torch.Tensor:
        """Writes one step into the buffers (one host-to-device copy, then device-side copies); returns
        sample_rows on the device, from the same copy."""
        n, num_seqs = len(input_ids), len(query_lens)
        last_row = tokens - 1  # the dummy's row: padding, never a real token's
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        qsl = starts + [last_row] * (self.query_start_loc.shape[0] - num_seqs - 1)
        lens = list(seq_lens) + [0] * (self.seq_lens.shape[0] - num_seqs)
        decode = [s for s, q in enumerate(query_lens) if q == 1]
        decode += [self.dummy] * (self.decode_ids.shape[0] - len(decode))
        tile_seq, tile_m = prefill_tiles([(s, q) for s, q in enumerate(query_lens) if q > 1], self.block_m)
        pad = self.tiles.shape[1] - len(tile_seq)
        tile_seq, tile_m = tile_seq + [self.dummy] * pad, tile_m + [0] * pad
        prefill_lens = [q if q > 1 else 0 for q in query_lens]
        prefill_lens += [0] * (self.prefill_lens.shape[0] - num_seqs)
        parts = [torch.tensor(input_ids + [0] * (tokens - n), dtype=torch.int64),
                 torch.tensor(positions + [0] * (tokens - n), dtype=torch.int64),
                 torch.cat([slots.long(), torch.full((tokens - n,), -1, dtype=torch.int64)]),
                 torch.tensor(qsl, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64),
                 torch.tensor(decode, dtype=torch.int64), torch.tensor(tile_seq + tile_m, dtype=torch.int64),
                 block_tables.long().flatten(), torch.tensor(prefill_lens, dtype=torch.int64),
                 torch.tensor(list(sample_rows), dtype=torch.int64)]
        flat = torch.cat(parts).to(self.input_ids.device)
        ids, pos, slot, qs, ln, dec, til, table, pre, rows = flat.split([p.numel() for p in parts])
        self.input_ids[:tokens].copy_(ids)
        self.positions[:tokens].copy_(pos)
        self.slot_mapping[:tokens].copy_(slot)
        self.query_start_loc.copy_(qs)
        self.seq_lens.copy_(ln)
        self.decode_ids.copy_(dec)
        self.tiles.copy_(til.view(2, -1))
        self.prefill_lens.copy_(pre)
        width = int(block_tables.shape[1]) if block_tables.dim() == 2 else 0
        if num_seqs and width:
            self.block_tables[:num_seqs, :width].copy_(table.view(num_seqs, width))
        return rows

    def fill_idle(self, tokens: int) -> None:
        """Every sequence the dummy, every slot skipped: what capture and warm-up run on."""
        self.fill(tokens, [], [], torch.empty(0, dtype=torch.int64), [], [], torch.empty(0, 0, dtype=torch.int32))

    def key_for(self, query_lens: list[int], block_table_width: int) -> tuple[int, int] | None:
        """(token bucket, decode bucket) of a step, or None when it runs eagerly."""
        if block_table_width > self.max_blocks_per_seq or len(query_lens) > self.max_num_seqs:
            return None
        decodes = sum(1 for q in query_lens if q == 1)
        prefills = sum(1 for q in query_lens if q > 1)
        if prefills == 0 or prefills > MAX_PREFILL_SEQS:
            return None
        n = sum(query_lens)
        tokens = next((t for t in self.token_buckets if t >= n + 1), None)
        dec = next((d for d in self.decode_buckets if d >= decodes), None)
        if tokens is None or dec is None:
            return None
        if tokens > ALWAYS_GRAPHED_TOKENS and tokens - (n + 1) > tokens // 8:
            return None
        return tokens, dec


class MixedGraphs:
    def __init__(self, model, kv_pool: torch.Tensor, block_size: int, max_num_seqs: int, max_blocks_per_seq: int,
                 max_num_batched_tokens: int, memory_pool: Any = None, fa3: bool = False):
        self.model = model
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.layout = MixedStepLayout(kv_pool.device, block_size, model.arch.num_heads, model.arch.head_dim,
                                      max_num_seqs, max_blocks_per_seq, max_num_batched_tokens, fa3)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.memory_pool = memory_pool

    def key_for(self, query_lens: list[int], block_table_width: int) -> tuple[int, int] | None:
        return self.layout.key_for(query_lens, block_table_width)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every (token bucket, decode bucket), largest first so the smaller ones reuse its memory."""
        for tokens in reversed(self.layout.token_buckets):
            for decodes in reversed(self.layout.decode_buckets):
                self._capture((tokens, decodes))
        torch.cuda.synchronize()

    def _capture(self, key: tuple[int, int]) -> None:
        tokens = key[0]
        self.layout.fill_idle(tokens)
        meta = self.layout.static_meta(key)
        args = (self.layout.input_ids[:tokens], self.layout.positions[:tokens], meta, self.kv_pool)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # off the capture: compiles kernels, creates handles
            for _ in range(2):
                self.model(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            self.outputs[key] = self.model(*args)
        if self.memory_pool is None:
            self.memory_pool = graph.pool()
        self.graphs[key] = graph

    @torch.inference_mode()
    def replay(self, key: tuple[int, int], input_ids: list[int], positions: list[int], meta: AttentionMetadata,
               query_lens: list[int], sample_rows: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [len(input_ids), hidden], sample_rows on the device) of a step described by host lists and its
        CPU metadata; hidden is a view of a static buffer, valid until the next replay."""
        tokens = key[0]
        _, seq_lens = meta.host_lists()
        rows = self.layout.fill(tokens, input_ids, positions, meta.slot_mapping, query_lens, seq_lens,
                                meta.block_tables, sample_rows)
        self.graphs[key].replay()
        return self.outputs[key][: len(input_ids)], rows

    @torch.inference_mode()
    def time_buckets(self, context: int, reps: int = 3) -> dict[int, tuple[float, float]]:
        """Per token bucket: (ms of a replay whose one prefill chunk fills the bucket, ms more per thousand tokens
        of context before that chunk), from replays with no decode rows at context 0 and at `context` (clipped to
        what a block table holds). What the step budget plans steps with (step_budget.BucketStepTimes). Reads
        pool blocks as they are (only the time matters) and writes none (every slot -1)."""
        bs = self.block_size
        num_blocks = self.kv_pool.shape[0]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times: dict[int, tuple[float, float]] = {}
        for tokens in self.layout.token_buckets:
            chunk = tokens - 1  # the last row is the dummy's
            far = max(0, min(context, self.layout.max_blocks_per_seq * bs - chunk))
            measured = []
            for ctx in (0, far):
                total = ctx + chunk
                table = (torch.arange(-(-total // bs), dtype=torch.int32) % num_blocks)[None]
                self.layout.fill(tokens, [0] * chunk, list(range(ctx, total)), torch.full((chunk,), -1), [chunk],
                                 [total], table)
                graph = self.graphs[(tokens, 0)]
                graph.replay()  # the first replay after another bucket's pays for its caches
                start.record()
                for _ in range(reps):
                    graph.replay()
                end.record()
                end.synchronize()
                measured.append(start.elapsed_time(end) / reps)
            per_k = max(0.0, (measured[1] - measured[0]) * 1e3 / far) if far else 0.0
            times[tokens] = (measured[0], per_k)
        self.layout.fill_idle(self.layout.token_buckets[-1])
        return times

    @torch.inference_mode()
    def verify(self) -> float:
        """A real mixed step (a chunk over a cached prefix, a fresh prompt, two decodes) through replay and
        through the eager forward; returns the largest difference relative to the eager output's magnitude.
        Writes K/V into the first pool blocks only (free before the first request)."""
        bs = self.block_size
        device = self.kv_pool.device
        gen = torch.Generator(device="cpu").manual_seed(0)
        contexts = [3 * bs + 5, 40, 2 * bs + 1, bs + 7]  # chunk over a prefix, fresh prompt, decode, decode
        new = [21, 40, 1, 1]
        tables, next_block = [], 0
        for ctx in contexts:
            count = -(-ctx // bs)
            tables.append(list(range(next_block, next_block + count)))
            next_block += count
        if next_block > self.kv_pool.shape[0]:
            raise RuntimeError("the KV pool is too small to check the mixed-step graphs")
        vocab = self.model.arch.vocab_size
        prompts = [torch.randint(0, vocab, (ctx,), generator=gen).tolist() for ctx in contexts]
        # 1. Every sequence's whole context through the eager forward: K/V in the pool.
        fill = build_metadata(contexts, contexts, tables, bs, device)
        flat = [t for p in prompts for t in p]
        self.model(torch.tensor(flat, device=device), torch.tensor([i for c in contexts for i in range(c)],
                                                                   device=device), fill, self.kv_pool)
        # 2. The mixed step, writing nothing (slots -1): its new tokens' K/V are already there from step 1.
        ids = [t for p, n in zip(prompts, new) for t in p[-n:]]
        pos = [i for c, n in zip(contexts, new) for i in range(c - n, c)]
        key = self.key_for(new, max(len(t) for t in tables))
        if key is None:
            raise RuntimeError("the check step does not fit a captured mixed-step graph")
        cpu_meta = build_metadata(new, contexts, tables, bs, "cpu")
        cpu_meta.slot_mapping = torch.full_like(cpu_meta.slot_mapping, -1)
        got = self.replay(key, ids, pos, cpu_meta, new)[0].float().clone()
        eager_meta = build_metadata(new, contexts, tables, bs, device)
        eager_meta.slot_mapping = torch.full_like(eager_meta.slot_mapping, -1)
        want = self.model(torch.tensor(ids, device=device), torch.tensor(pos, device=device), eager_meta,
                          self.kv_pool).float()
        torch.cuda.synchronize()
        if not torch.isfinite(got).all():
            return float("inf")
        return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
