"""A short fingerprint of what makes two engines' KV interchangeable: the model (config.json and a sample of
the weights) and the KV layout (dtype, block size). Prefill publishes it on its side channel; decode refuses
to load KV from a peer whose fingerprint differs from its own, because KV computed by other weights (a
fine-tune, another seed, another revision of the same architecture) has the right shape and is silently
wrong. Sampling the weights keeps this cheap for a 15 GB checkpoint: the safetensors header (names, shapes,
offsets) plus a few small slices of the tensor data spread over each file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 4096
MAX_HEADER_BYTES = 100 << 20


def _hash_weight_file(h, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        head = f.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
        h.update(f.read(min(header_len, MAX_HEADER_BYTES)))
        start = 8 + header_len
        span = max(0, size - start - SAMPLE_BYTES)
        for i in range(SAMPLES_PER_FILE):
            f.seek(start + span * i // max(1, SAMPLES_PER_FILE - 1))
            h.update(f.read(SAMPLE_BYTES))


def model_fingerprint(model_dir: str | Path | None, kv_dtype: str, block_size: int) -> str:
    """Hex digest naming the model and KV layout; a missing model directory contributes its path only."""
    h = hashlib.sha256(f"kv:{kv_dtype}:{block_size}".encode())
    path = Path(model_dir) if model_dir else None
    if path is not None and path.is_dir():
        config = path / "config.json"
        if config.is_file():
            h.update(config.read_bytes())
        for weights in sorted(path.glob("*.safetensors")):
            _hash_weight_file(h, weights)
    else:
        h.update(f"model:{model_dir}".encode())
    return h.hexdigest()[:24]
