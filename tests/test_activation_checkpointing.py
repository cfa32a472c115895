"""Activation checkpointing per block (``training.activation_checkpointing``): what each mode computes again in
backward, counted op by op, what full checkpointing keeps, counted from the tensors autograd saves, and the
gradients both give (those of no checkpointing)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meridian.workers.contracts.config import ActivationCheckpointing
from meridian.workers.contracts.model_config import ModelConfig, ModelFamily, model_preset
from meridian.workers.model.build import build_model
from meridian.workers.model.gpt import per_sample_loss
from meridian.workers.parallel.checkpointing import apply_activation_checkpointing

MODELS = {
    "gpt": model_preset("nano"),
    "llama": ModelConfig(family=ModelFamily.LLAMA, n_layers=2, d_model=64, n_heads=8, n_kv_heads=2, ffn_hidden=96,
                         seq_len=32),
}


MATMULS = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu"}
ELEMENTWISE = {"gelu", "silu", "native_layer_norm", "rsqrt"}


class _Ops(TorchDispatchMode):
    """Counts the matmul-like and the cheap element-wise ops that run."""

    def __init__(self) -> None:
        super().__init__()
        self.matmuls = self.elementwise = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func.overloadpacket.__name__
        self.matmuls += name in MATMULS
        self.elementwise += name in ELEMENTWISE
        return func(*args, **(kwargs or {}))


def _run(cfg: ModelConfig, mode: ActivationCheckpointing):
    torch.manual_seed(0)
    model = build_model(cfg)
    names = [n for n, _ in model.named_parameters()]
    apply_activation_checkpointing(model.blocks, mode)
    assert [n for n, _ in model.named_parameters()] == names  # the block stays in place, its names unchanged
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    ops = _Ops()
    with ops:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = per_sample_loss(model(x), x).mean()
        loss.backward()
    return sum(saved), ops, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", list(MODELS))
def test_checkpointing_recomputes_what_it_should_and_gives_the_same_gradients(family):
    cfg = MODELS[family]
    none, selective, full = (_run(cfg, m) for m in ActivationCheckpointing)
    # selective keeps the matmuls' and attention's outputs: only the element-wise ops run again
    assert selective[1].matmuls == none[1].matmuls < full[1].matmuls
    assert none[1].elementwise < selective[1].elementwise == full[1].elementwise
    assert full[0] < none[0]  # full keeps each block's input alone (bytes autograd saves in forward)
    for _, _, grads in (selective, full):
        for n, g in grads.items():
            assert torch.allclose(g, none[2][n], rtol=1e-5, atol=1e-7), n
