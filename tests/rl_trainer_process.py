"""A trainer in its own process, for the RL tests: it holds a copy of the model's weights under their Hugging
Face names, perturbs them as a training step would, pushes them to a running engine over a gloo broadcast
group (in bfloat16, so the engine converts dtypes), and saves the same weights as a checkpoint for the test's
reference model.

    python -m tests.rl_trainer_process ENGINE_URL MODEL_DIR OUT_DIR VERSION [API_KEY]
"""

from __future__ import annotations

import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from token_engine.models.loader import iter_checkpoint
from token_engine.rl.trainer import TrainerGroup, push_weights


def training_step(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A perturbation large enough to change a tiny random model's greedy choices; bfloat16 as trainers send."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in weights.items():
        noise = torch.randn(tensor.shape, generator=generator) * (tensor.float().std() + 1e-3) * 0.5
        out[name] = (tensor.float() + noise).to(torch.bfloat16)
    return out


def main(url: str, model_dir: str, out_dir: str, version: str, api_key: str | None = None) -> None:
    weights = dict(iter_checkpoint(model_dir))
    new = training_step(weights, seed=1234)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in Path(model_dir).iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != "model.safetensors.index.json":
            shutil.copyfile(path, out / path.name)
    # the reference checkpoint holds exactly what the engine receives: bfloat16 values, widened to float32
    save_file({n: t.float().contiguous() for n, t in new.items()}, str(out / "model.safetensors"))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, timeout=120, headers=headers) as http:
        group = TrainerGroup("127.0.0.1", 0)
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(http.post, "/init_weight_transfer_engine", json={"init_info": group.init_info()})
            group.connect()
            joined.result().raise_for_status()
        http.post("/pause", params={"mode": "keep"}).raise_for_status()
        names = sorted(new)
        push_weights(http, group, [(n, new[n]) for n in names], version=version, chunk=7)
        http.post("/resume").raise_for_status()
    print("pushed", len(names))


if __name__ == "__main__":
    main(*sys.argv[1:])
