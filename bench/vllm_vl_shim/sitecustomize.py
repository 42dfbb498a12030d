"""Loaded at start-up by a vLLM 0.32 CPU process whose PYTHONPATH names this folder (bench/peers.py,
``vllm032_vl_pythonpath``). PyPI's torchvision is built for CUDA torch: beside the CPU torch its C++ ops do not
load, and ``import torchvision`` then fails registering fake kernels for ``nms`` and ``qnms``, ops it never
defined. Defining their schemas here lets it import; the image transforms vLLM's Qwen-VL processors use are plain
torch, and the ops themselves stay unavailable."""

try:
    import torch

    _LIBRARY = torch.library.Library("torchvision", "DEF")
    _LIBRARY.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARY.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
except Exception:  # noqa: BLE001, S110 -- not a torch process: nothing to prepare
    pass
