"""Runs the model for one scheduled step: owns the KV pool, builds input tensors and AttentionMetadata,
and returns the logits the sampler (and prompt logprobs) need, nothing more."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from token_engine.core.scheduler import ScheduledSequence
from token_engine.layers.attention import AttentionMetadata, allocate_kv_pool, build_metadata, warm_up_cuda

if TYPE_CHECKING:
    from token_engine.core.mixed_graphs import MixedGraphs

log = logging.getLogger("token_engine")
# Mixed prefill + decode steps replay CUDA graphs (token_engine.core.mixed_graphs); off: they run eagerly.
MIXED_GRAPHS = True


def kv_block_bytes(arch, block_size: int) -> int:
    """Bytes of one block across all layers (K and V)."""
    return block_size * arch.kv_bytes_per_token


@dataclass
class StepLogits:
    sample_logits: torch.Tensor  # [number of sampling sequences, vocab], in scheduled order
    prompt_logits: dict[str, tuple[int, torch.Tensor]]  # seq_id -> (first position, logits [rows, vocab])


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: str | torch.device = "cpu",
                 max_num_seqs: int = 256, max_model_len: int = 4096, cuda_graphs: bool = True,
                 max_num_batched_tokens: int = 2048):
        self.model = model
        self.arch = model.arch
        self.block_size = block_size
        self.device = torch.device(device)
        arch = self.arch
        self.kv_pool = allocate_kv_pool(num_blocks, arch.num_layers, block_size, arch.num_kv_heads,
                                        arch.head_dim, arch.dtype, self.device)
        self.decode_graphs = None
        self.mixed_graphs: MixedGraphs | None = None
        self.last_step_tokens = 0  # tokens the last step computed, padding of a graphed mixed step included
        if cuda_graphs and self.device.type == "cuda":
            from token_engine.core.cuda_graphs import DecodeGraphs

            # Decode steps replay a captured graph: at small batch, kernel launch gaps set the step time.
            self.decode_graphs = DecodeGraphs(model, self.kv_pool, block_size, max_num_seqs,
                                              max_blocks_per_seq=-(-max_model_len // block_size))
            self.decode_graphs.capture()
        if self.device.type == "cuda":
            self._warm_up_cuda(max_num_seqs)
        if self.decode_graphs is not None and MIXED_GRAPHS:
            self._capture_mixed_graphs(max_num_seqs, max_model_len, max_num_batched_tokens)

    def _capture_mixed_graphs(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> None:
        """Mixed steps replay graphs too, once a replay is proved equal to the eager forward (else eager). Their
        prefill chunks go through FA3 where the eager steps' do (attention_cuda.PREFILL_FA3); where such graphs
        fail to capture or to match, they are captured again with the paged kernel."""
        from token_engine.core.mixed_graphs import VERIFY_TOLERANCE, MixedGraphs
        from token_engine.layers import attention_cuda

        assert self.decode_graphs is not None
        for fa3 in dict.fromkeys((attention_cuda.PREFILL_FA3, False)):
            graphs = MixedGraphs(self.model, self.kv_pool, self.block_size, max_num_seqs,
                                 -(-max_model_len // self.block_size), max_num_batched_tokens,
                                 memory_pool=self.decode_graphs.memory_pool, fa3=fa3)
            kernel = "FA3" if fa3 else "the paged kernel"
            try:
                graphs.capture()
                error = graphs.verify()
            except Exception as exc:  # noqa: BLE001 - capture or a kernel failed here: the next try, else eager
                log.warning("mixed-step CUDA graphs with %s off: %s", kernel, exc)
                continue
            if not error <= VERIFY_TOLERANCE:
                log.warning("mixed-step CUDA graphs with %s off: a replay differs from the eager step by %.3g "
                            "(relative)", kernel, error)
                continue
            log.info("mixed-step CUDA graphs: %d captured with %s, replay within %.2g of the eager step",
                     len(graphs.graphs), kernel, error)
            self.mixed_graphs = graphs
            return

    @torch.inference_mode()
    def _warm_up_cuda(self, max_num_seqs: int) -> None:
        """Compiles, before the first request, the kernels that decode graph capture did not run: the mixed
        step's decode attention (every merge width) and a prefill step's path. Writes no KV (slots -1)."""
        from token_engine.models.llama import FEW_ROWS

        warm_up_cuda(self.kv_pool, self.arch.num_heads, max_num_seqs, self.block_size)
        tokens = FEW_ROWS + 1  # past the few-rows kernels: the prefill path
        blocks = list(range(-(-tokens // self.block_size)))
        meta = build_metadata([tokens], [tokens], [blocks], self.block_size, self.device)
        meta.slot_mapping = torch.full_like(meta.slot_mapping, -1)
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        hidden = self.model.forward(ids, torch.arange(tokens, device=self.device), meta, self.kv_pool)
        self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize()

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence]) -> StepLogits:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        sample_rows: list[int] = []
        prompt_spans: list[tuple[str, int, int, int]] = []  # seq_id, first position, row start, row count
        row = 0
        for s in scheduled:
            seq = s.seq
            start = seq.num_computed_tokens
            end = start + s.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(s.num_new_tokens)
            seq_lens.append(end)
            tables.append(seq.block_table)
            if seq.options.prompt_logprobs is not None and start < seq.prompt_len - 1:
                # Position j's logits score prompt token j + 1.
                count = min(end, seq.prompt_len - 1) - start
                prompt_spans.append((seq.seq_id, start, row, count))
            row += s.num_new_tokens
            if s.samples:
                sample_rows.append(row - 1)

        cpu_meta = build_metadata(query_lens, seq_lens, tables, self.block_size, "cpu")
        mixed = self.mixed_graphs
        key = mixed.key_for(query_lens, int(cpu_meta.block_tables.shape[1])) if mixed is not None else None
        self.last_step_tokens = len(input_ids)
        if mixed is not None and key is not None:
            hidden, rows = mixed.replay(key, input_ids, positions, cpu_meta, query_lens, sample_rows)
            self.last_step_tokens = key[0]
        else:
            meta, ids, pos, rows = self._to_device(cpu_meta, input_ids, positions, sample_rows)
            if self.decode_graphs is not None and self.decode_graphs.can_replay(meta):
                hidden = self.decode_graphs.replay(ids, pos, meta)
            else:
                hidden = self.model.forward(ids, pos, meta, self.kv_pool)

        vocab = self.arch.vocab_size
        if sample_rows:
            sample_logits = self.model.compute_logits(hidden[rows])
        else:
            sample_logits = torch.empty(0, vocab, device=self.device)
        prompt_logits = {
            seq_id: (first, self.model.compute_logits(hidden[row_start:row_start + count]))
            for seq_id, first, row_start, count in prompt_spans
        }
        return StepLogits(sample_logits, prompt_logits)

    def _to_device(self, meta: AttentionMetadata, input_ids: list[int], positions: list[int], sample_rows: list[int]):
        """Moves the step's integer inputs to the device in one host-to-device copy (each copy is a sync)."""
        host = (meta.query_start_loc.tolist(), meta.seq_lens.tolist())  # the CPU attention path wants lists
        parts = [torch.tensor(input_ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                 torch.tensor(sample_rows, dtype=torch.int64), meta.slot_mapping, meta.query_start_loc.long(),
                 meta.seq_lens.long(), meta.block_tables.long().flatten()]
        flat = torch.cat(parts)
        if self.device.type != "cpu":
            flat = flat.to(self.device)
        ids, pos, rows, slots, starts, lens, tables = flat.split([p.numel() for p in parts])
        device_meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=starts.int(), seq_lens=lens.int(),
            block_tables=tables.view(meta.block_tables.shape).int(), block_size=meta.block_size,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, _host=host)
        return device_meta, ids, pos, rows
