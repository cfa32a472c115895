"""Which floating-point precision a step computes in, on this device."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from meridian.workers.contracts.config import Precision


def resolve_precision(precision: Precision, device: torch.device) -> Precision:
    """``auto`` → bf16 on a GPU that supports it natively (Ampere and later), fp32 elsewhere: bf16 autocast on CPU
    is slower, and torch's default ``is_bf16_supported()`` also says yes for GPUs that only emulate it (Volta,
    Turing), where it is slower than fp32."""
    if precision is not Precision.AUTO:
        return precision
    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return Precision.BF16
    return Precision.FP32


def autocast_context(precision: Precision, device: torch.device) -> AbstractContextManager[object]:
    if resolve_precision(precision, device) is Precision.BF16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def mixed_precision(precision: Precision, device: torch.device) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``precision`` on ``device``: for bf16, parameters cast to bf16 for forward and backward,
    gradients reduced in fp32 into the fp32 shards the optimizer steps (no autocast then); fp32 throughout
    otherwise."""
    if resolve_precision(precision, device) is Precision.BF16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()
