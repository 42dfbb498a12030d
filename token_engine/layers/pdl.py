"""Programmatic dependent launch (Hopper and later) for the decode path's Triton kernels.

A decode step is a chain of a few hundred short kernels, and in a CUDA graph each one still starts only after
the one before has drained: about a microsecond per kernel of launch and ramp-up in which HBM idles. Launched
with PDL, a kernel's blocks are scheduled while the previous kernel runs and wait (griddepcontrol.wait) before
their first memory access, so launch and set-up overlap the previous kernel's tail.

Rule for a kernel that takes PDL: `pdl_wait_then_release(PDL)` before any load or store of activations. The
wait returns once the previous kernel has completed and its writes are visible; every kernel in the chain waits
before finishing, so anything earlier has completed too. Off (PDL=False: CPU interpreter, older GPUs, or
ENABLED off) the instructions are left out.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

ENABLED = True  # benchmarks switch it off to compare


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL."""
    if not (ENABLED and t.is_cuda):
        return False
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device()) >= 9


def launch_args(t: torch.Tensor) -> dict:
    """The kernel's PDL constexpr and the launch option, which go together: kernel[grid](..., **launch_args(x))."""
    return {"PDL": True, "launch_pdl": True} if use_pdl(t) else {"PDL": False}


@triton.jit
def pdl_wait_then_release(PDL: tl.constexpr):
    if PDL:
        tl_cuda.gdc_wait()  # the previous kernel has completed: its outputs are readable, its inputs writable
        tl_cuda.gdc_launch_dependents()  # the next kernel may be scheduled now
