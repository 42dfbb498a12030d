"""The engine side of the RL control plane. Every method runs on the engine thread (through
``AsyncEngine.call``), between steps, so no step ever sees half a weight update.

State kept here: the weight version (labels output tokens through ``Sequence.weight_marks``), the weight epoch
(salts prefix-cache hashes, so KV computed with older weights is never served to a later request), the transfer
receiver, whether an update is open, and whether the engine sleeps.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from token_engine.rl.transfer import DistributedReceiver, IpcReceiver, create_receiver
from token_engine.rl.weights import WeightTable, WeightUpdateError, checksums, zero_weights

if TYPE_CHECKING:
    from token_engine.core.engine import LLMEngine

log = logging.getLogger("token_engine.rl")


class WeightControl:
    def __init__(self, llm: LLMEngine):
        self.llm = llm
        self.table = WeightTable(llm.model)
        self.receiver: DistributedReceiver | IpcReceiver | None = None
        self.updating = False
        self.asleep = False
        self.sleep_level = 0
        self.last_update: dict = {}  # what the last finished update took, for /weight_info and benchmarks

    # ---- versions and the prefix cache -------------------------------------------------------------
    def set_version(self, version: str) -> None:
        """Tokens sampled from now on are labelled ``version``."""
        llm = self.llm
        llm.weight_version = version
        for state in llm.requests.values():
            for seq in state.seqs:
                if not seq.is_finished and seq.weight_marks[-1][0] != version:
                    if seq.weight_marks[-1][1] == seq.num_output_tokens:
                        seq.weight_marks[-1] = (version, seq.num_output_tokens)
                    else:
                        seq.weight_marks.append((version, seq.num_output_tokens))

    def weights_changed(self) -> None:
        """New weights: later requests hash their blocks under a new epoch and the cached index is dropped."""
        self.llm.new_weight_epoch()

    # ---- the update lifecycle ----------------------------------------------------------------------
    def _awake(self, what: str) -> None:
        if self.asleep:
            raise WeightUpdateError(f"the engine is asleep (level {self.sleep_level}): POST /wake_up before "
                                    f"{what}", status=409)

    def init_transfer(self, init_info: dict, backend: str | None) -> str:
        self._awake("init_weight_transfer_engine")
        if not isinstance(init_info, dict):
            raise WeightUpdateError("init_info must be an object", param="init_info")
        if backend is None:  # vLLM picks the backend from --weight-transfer-config; the body shape decides here
            backend = "nccl" if "master_address" in init_info or "master_port" in init_info else "ipc"
        receiver = create_receiver(backend, init_info, self.llm.runner.device)
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = receiver
        return receiver.kind

    def start(self) -> None:
        self._awake("start_weight_update")
        if self.receiver is None:
            raise WeightUpdateError("no weight transfer engine: POST /init_weight_transfer_engine first", status=409)
        self.updating = True
        self._started = time.perf_counter()
        self._received = 0

    def update(self, update_info: dict) -> int:
        self._awake("update_weights")
        if not self.updating:
            raise WeightUpdateError("update_weights without start_weight_update: POST /start_weight_update first",
                                    status=409)
        if not isinstance(update_info, dict):
            raise WeightUpdateError("update_info must be an object", param="update_info")
        assert self.receiver is not None
        try:
            count = self.receiver.receive(self.table, update_info)
        except RuntimeError as exc:  # the group broke mid-broadcast (trainer gone, timeout): some tensors written
            self.weights_changed()
            raise WeightUpdateError(f"weight transfer failed mid-update ({exc}); resend the whole update",
                                    status=502) from None
        self._received += count
        if count:
            self.weights_changed()
        return count

    def finish(self, version: str | None) -> None:
        self._awake("finish_weight_update")
        if not self.updating:
            raise WeightUpdateError("finish_weight_update without start_weight_update", status=409)
        self.updating = False
        self.last_update = {"tensors": self._received, "seconds": time.perf_counter() - self._started}
        if version is not None:
            self.set_version(version)
        log.info("weight update finished: %d tensors in %.3f s, version %s", self._received,
                 self.last_update["seconds"], self.llm.weight_version)

    def reload(self, path: str, version: str | None) -> int:
        """All weights from a checkpoint directory on this machine (SGLang's update_weights_from_disk)."""
        self._awake("reload_weights")
        count = self.table.load_checkpoint(path)
        self.weights_changed()
        if version is not None:
            self.set_version(version)
        return count

    def shutdown_transfer(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = None
        self.updating = False

    # ---- checks ------------------------------------------------------------------------------------
    def checksums(self) -> dict[str, str]:
        return checksums(self.llm.model)

    def reset(self) -> None:
        self._awake("weight_checker reset")
        zero_weights(self.llm.model)
        self.weights_changed()

    # ---- sleep -------------------------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Marks the engine asleep and drops the prefix cache. The weights and KV pool stay allocated (memory is
        not given back yet): what sleep guarantees here is that generation stops and updates are refused."""
        self.asleep, self.sleep_level = True, level
        self.llm.reset_prefix_cache()

    def wake_up(self) -> None:
        self.asleep, self.sleep_level = False, 0


def epoch_salt(cache_salt: str | None, epoch: int) -> str | None:
    """The cache salt a request hashes its blocks under: the caller's, plus the weight epoch after an update."""
    if epoch == 0:
        return cache_salt
    return f"{cache_salt or ''}\x00weights:{epoch}"


def weight_spans(marks: list[tuple[str, int]], num_tokens: int) -> list[tuple[str, int, int]]:
    """[(version, start, end)] over ``num_tokens`` output tokens from the marks (version, first token)."""
    spans = []
    for i, (version, start) in enumerate(marks):
        end = marks[i + 1][1] if i + 1 < len(marks) else num_tokens
        end = min(end, num_tokens)
        if end > start:
            spans.append((version, start, end))
    return spans
