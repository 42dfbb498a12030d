"""Where a trainer's tensors land: Hugging Face names resolved onto the engine's live parameters.

Our attention and MLP projections are fused (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``), so a
checkpoint name such as ``model.layers.3.self_attn.k_proj.weight`` resolves to rows of the fused parameter. Every
name, shape and dtype of an update is resolved and checked before any tensor is received or written, so a bad
update is refused whole and the engine keeps serving the weights it had.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

FUSED_SHARDS = {  # checkpoint projection -> (fused parameter, shard); as the model's loader fuses them
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
WIRE_DTYPES = {  # the dtype names trainers send (str(torch.dtype) without "torch.")
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "float64": torch.float64,
}
MAX_TENSORS_PER_UPDATE = 100_000


class WeightUpdateError(ValueError):
    """A refused update: ``status`` is the HTTP answer (400 bad input, 409 wrong state), ``param`` the field."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


@dataclass(frozen=True)
class Destination:
    """Where one sent tensor goes: a parameter, or rows [start, end) of a fused one."""

    name: str
    dtype: torch.dtype  # as sent
    shape: tuple[int, ...]
    param: torch.Tensor
    start: int | None = None
    end: int | None = None

    def view(self) -> torch.Tensor:
        return self.param if self.start is None else self.param[self.start:self.end]


class WeightTable:
    """The model's parameters by checkpoint name (fused ones by their parts)."""

    def __init__(self, model):
        self.model = model
        self.params = dict(model.named_parameters())
        self.tied_head = getattr(model, "lm_head", None) is None

    def resolve(self, name: str) -> tuple[torch.Tensor, int | None, int | None] | None:
        if name in self.params:
            return self.params[name], None, None
        if name == "lm_head.weight" and self.tied_head:
            return self.params["model.embed_tokens.weight"], None, None
        module_path, _, leaf = name.rpartition(".")
        parent, _, last = module_path.rpartition(".")
        if last in FUSED_SHARDS:
            fused, shard = FUSED_SHARDS[last]
            param = self.params.get(f"{parent}.{fused}.{leaf}")
            if param is not None:
                start, end = self.model._fused_shard_slice(fused, shard)
                return param, start, end
        return None

    def plan(self, names: list, dtype_names: list, shapes: list) -> list[Destination]:
        """Checks a whole update's metadata; raises WeightUpdateError naming the first problem."""
        if not (len(names) == len(dtype_names) == len(shapes)):
            raise WeightUpdateError(f"names, dtype_names and shapes differ in length ({len(names)}, "
                                    f"{len(dtype_names)}, {len(shapes)})", param="update_info")
        if len(names) > MAX_TENSORS_PER_UPDATE:
            raise WeightUpdateError(f"at most {MAX_TENSORS_PER_UPDATE} tensors per update", param="names")
        out: list[Destination] = []
        seen: set[str] = set()
        for name, dtype_name, shape in zip(names, dtype_names, shapes):
            if not isinstance(name, str):
                raise WeightUpdateError(f"parameter name {name!r} is not a string", param="names")
            if name in seen:
                raise WeightUpdateError(f"parameter {name!r} is sent twice in one update", param="names")
            seen.add(name)
            dtype = WIRE_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
            if dtype is None:
                raise WeightUpdateError(f"parameter {name!r}: unsupported dtype {dtype_name!r} (one of "
                                        f"{', '.join(WIRE_DTYPES)})", param="dtype_names")
            if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                      for d in shape):
                raise WeightUpdateError(f"parameter {name!r}: shape {shape!r} is not a list of sizes",
                                        param="shapes")
            found = self.resolve(name)
            if found is None:
                raise WeightUpdateError(f"unknown parameter {name!r}: the model has no such weight", param="names")
            param, start, end = found
            dest = Destination(name, dtype, tuple(shape), param, start, end)
            want = tuple(dest.view().shape)
            if dest.shape != want:
                raise WeightUpdateError(f"parameter {name!r}: sent shape {list(dest.shape)}, the model's is "
                                        f"{list(want)}", param="shapes")
            out.append(dest)
        return out

    @torch.no_grad()
    def write(self, dest: Destination, tensor: torch.Tensor) -> None:
        """Copies one received tensor into its live parameter, converting dtype and device."""
        dest.view().copy_(tensor)

    @torch.no_grad()
    def load_checkpoint(self, model_dir: str) -> int:
        """Reads every tensor of a checkpoint directory, checks all of them, then writes them; the count written."""
        from token_engine.models.loader import iter_checkpoint

        try:
            tensors = [(n, t) for n, t in iter_checkpoint(model_dir) if "rotary_emb.inv_freq" not in n]
        except (OSError, ValueError) as exc:
            raise WeightUpdateError(f"cannot read a checkpoint from {model_dir!r}: {exc}",
                                    param="weights_path") from None
        except Exception as exc:  # noqa: BLE001 - a corrupt safetensors file (SafetensorError)
            raise WeightUpdateError(f"cannot read a checkpoint from {model_dir!r}: {type(exc).__name__}: {exc}",
                                    param="weights_path") from None
        dests = self.plan([n for n, _ in tensors], [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                          [list(t.shape) for _, t in tensors])
        covered = {d.name for d in dests}
        missing = self.model.expected_checkpoint_names() - covered
        if missing:
            raise WeightUpdateError(f"checkpoint {model_dir!r} lacks {len(missing)} weights, e.g. "
                                    f"{sorted(missing)[:3]}", param="weights_path")
        for dest, (_, tensor) in zip(dests, tensors):
            self.write(dest, tensor)
        return len(dests)


def checksums(model) -> dict[str, str]:
    """sha256 of every parameter's bytes, by the engine's parameter name (fused names, as held)."""
    out = {}
    for name, param in model.named_parameters():
        data = param.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        out[name] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    return out


@torch.no_grad()
def zero_weights(model) -> None:
    for param in model.parameters():
        param.zero_()
