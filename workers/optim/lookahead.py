"""The look-ahead update: what one more AdamW step would make of the committed parameters, moments untouched.

    committed <- AdamW(committed, exact global gradient)     (the optimizer's own step; moments advance)
    ahead     <- AdamW(committed, local gradient)            (this function; moments do not)

The same formula as ``torch.optim.AdamW``'s single-tensor step, from the committed values and the moments as they
stand, written into ``out`` (the parameters the next forward runs at). Elementwise, so it applies to any shard.
"""

from __future__ import annotations

import math
from typing import Any

import torch


@torch.no_grad()
def lookahead_adamw(
    committed: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict[str, Any] | None],
    out: list[torch.Tensor], *, lr: float, weight_decay: float, beta1: float, beta2: float, eps: float, step: int,
) -> None:
    """``out[i] <- AdamW(committed[i], grads[i])`` as AdamW step ``step`` (1-based) would make it, with the moments
    of ``states[i]`` (``None`` before the first committed update: zero moments), which stay as they are."""
    if not committed:
        return
    if all(states):
        m = torch._foreach_mul([st["exp_avg"] for st in states], beta1)  # type: ignore[index]
        v = torch._foreach_mul([st["exp_avg_sq"] for st in states], beta2)  # type: ignore[index]
    else:
        m, v = torch._foreach_mul(grads, 0.0), torch._foreach_mul(grads, 0.0)
    torch._foreach_add_(m, grads, alpha=1 - beta1)
    torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
    torch._foreach_sqrt_(v)  # the denominator, in place
    torch._foreach_div_(v, math.sqrt(1 - beta2**step))
    torch._foreach_add_(v, eps)
    torch._foreach_div_(m, v)
    ahead = torch._foreach_mul(committed, 1 - lr * weight_decay)
    torch._foreach_add_(ahead, m, alpha=-lr / (1 - beta1**step))
    torch._foreach_copy_(out, ahead)
