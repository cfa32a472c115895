"""AdamW state put back from a snapshot or checkpoint steps like the optimizer it was taken from, on every device.

Found on an H200: a GPU job restored from its snapshot failed its first step with "state_steps is on cpu,
different from other tensors on cuda:0" (the fused CUDA AdamW reads its step counters on the device; the
loaders made them on the CPU). The CUDA case runs where there is a GPU (docs/benchmarks/gpu.md).
"""

from __future__ import annotations

import pytest
import torch

from meridian.workers.contracts.config import OptimConfig
from meridian.workers.optim.adamw import full_state_of, load_full_state, make_adamw, step_counter

CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))


def _stepped(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        for i, p in enumerate(params):
            g = torch.Generator().manual_seed(1000 * step + i)
            p.grad = torch.randn(p.shape, generator=g).to(p.device)
        optimizer.step()


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_loaded_adamw_state_steps_on_like_the_optimizer_it_was_taken_from(device):
    def model() -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return [torch.randn(8, 4, generator=g).to(device).requires_grad_(),
                torch.randn(4, generator=g).to(device).requires_grad_()]  # fmt: skip

    def adamw(params):
        return make_adamw([{"params": params, "weight_decay": 0.1}], OptimConfig(lr=0.01))

    first = model()
    running = adamw(first)
    _stepped(first, running, range(3))
    state = full_state_of(running, [("w", first[0]), ("b", first[1])])

    second = model()
    with torch.no_grad():
        for a, b in zip(second, first, strict=True):
            a.copy_(b)
    restored = adamw(second)
    load_full_state(restored, [("w", second[0]), ("b", second[1])], state)
    for p in second:  # where torch keeps the counter of an optimizer like this one
        assert restored.state[p]["step"].device == running.state[first[0]]["step"].device

    _stepped(first, running, range(3, 5))
    _stepped(second, restored, range(3, 5))
    for a, b in zip(second, first, strict=True):
        assert torch.equal(a, b)


def test_the_step_counter_is_on_the_parameters_device_for_fused_kernels_and_on_the_cpu_otherwise():
    param = torch.zeros(2)
    elsewhere = torch.empty(2, device="meta")  # a device that is not the CPU, on any machine
    fused = torch.optim.AdamW([param], fused=True)
    single_tensor = torch.optim.AdamW([param], foreach=False)
    assert step_counter(fused, 3, elsewhere).device == elsewhere.device
    assert step_counter(single_tensor, 3, elsewhere).device == torch.device("cpu")
    assert float(step_counter(single_tensor, 3, elsewhere)) == 3.0
    assert step_counter(fused, 3, elsewhere).dtype == torch.float32
