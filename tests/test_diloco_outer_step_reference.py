"""DiLoCo's outer step against ``torch.optim.SGD`` on the mean delta, a change in the number of datacenters, the
fragment schedule's invariants, and the codecs on empty and low-precision input.

The existing DiLoCo tests check H = 1 with plain outer SGD (no momentum) and the streaming merge with overlap;
here plain DiLoCo (H = 3, no overlap: the weights become the outer parameters) with outer momentum, Nesterov
and heavy-ball, over datacenters of 2 + 1 ranks, on a model with a frozen parameter, one that never gets a
gradient and one with no elements. The reference is one AdamW replica per DC and a real
``torch.optim.SGD(momentum=0.9, nesterov=...)`` over the outer parameters whose ``.grad`` is the DCs' mean
``anchor - theta``. The engine gives a parameter that gets no gradient a zero one (the reference does the same,
so AdamW's weight decay moves it, where torch's AdamW skips a parameter whose ``.grad`` is None). Measured
difference: ≤ 2.4e-7; checked at rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from sync_helpers import GLOBAL_BATCH, lr_of, params_of, share_loss, toy_batch, train_steps
from torch import nn

from meridian.workers.contracts.config import (
    DiLoCoConfig,
    OptimConfig,
    SyncConfig,
    SyncStrategy,
)
from meridian.workers.data.text import rank_slice
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.optim.adamw import build_adamw
from meridian.workers.sync.compression import Bf16Codec, ErrorFeedback, Int4Codec, Int8Codec
from meridian.workers.sync.diloco import DiLoCoSync
from meridian.workers.sync.diloco_schedule import FragmentSchedule, split_fragments, warmup_cycle

OPTIM = OptimConfig(lr=0.05, weight_decay=0.1, grad_clip=0.5, warmup_steps=0)
H = 3
LR_OUT, MU = 0.7, 0.9


class Odd(nn.Module):
    """Toy regression with a frozen parameter, a never-used one and a zero-size one."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 7)
        self.empty = nn.Parameter(torch.zeros(0, 3))
        self.frozen = nn.Parameter(torch.randn(7) * 0.1, requires_grad=False)
        self.unused = nn.Parameter(torch.randn(5))
        self.l2 = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(F.gelu(self.l1(x)) + self.frozen + self.empty.sum())


def odd_model() -> Odd:
    torch.manual_seed(0)
    return Odd()


def _sync(nesterov: bool) -> SyncConfig:
    return SyncConfig(
        strategy=SyncStrategy.DILOCO, inter_dc_chunk_mb=40 / 2**20,
        diloco=DiLoCoConfig(inner_steps=H, outer_lr=LR_OUT, outer_momentum=MU, nesterov=nesterov),
    )


def _engine(rank: int, dcs: tuple[str, ...], nesterov: bool) -> DiLoCoSync:
    return DiLoCoSync(odd_model(), DCGroups(DCLayout(dcs), rank), _sync(nesterov), OPTIM)


def _close(e: DiLoCoSync) -> None:
    e.close()
    e.groups.destroy()


def _plain(rank, world, dcs, nesterov, steps):
    e = _engine(rank, dcs, nesterov)
    train_steps(e, rank, world, steps=steps, micro=2)
    e.synchronize()
    out = params_of(e.model), e.optimizer_state()["diloco"]
    _close(e)
    return out


def _inner_step(layout: DCLayout, replicas: dict[str, nn.Module], opts, step: int) -> None:
    for dc, model in replicas.items():
        for r in layout.ranks_in(dc):
            share = rank_slice(GLOBAL_BATCH, r, layout.world_size)
            x, y = toy_batch(step, share.start, share.stop)
            (share_loss(model, x, y) * layout.world_size / len(layout.ranks_in(dc))).backward()
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)  # FSDP2 reduce-scatters a zero gradient for an unused parameter
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip)
        for g in opts[dc].param_groups:
            g["lr"] = lr_of(step)
        opts[dc].step()
        opts[dc].zero_grad()


class Reference:
    """One AdamW replica per DC and ``torch.optim.SGD`` over the outer parameters."""

    def __init__(self, dcs: tuple[str, ...], nesterov: bool) -> None:
        self.layout = DCLayout(dcs)
        self.replicas = {dc: odd_model() for dc in self.layout.dcs}
        self.opts = {dc: build_adamw(m, OPTIM) for dc, m in self.replicas.items()}
        first = self.replicas[self.layout.dcs[0]]
        self.anchor = {n: p.detach().clone() for n, p in first.named_parameters() if p.requires_grad}
        self.outer = torch.optim.SGD(list(self.anchor.values()), lr=LR_OUT, momentum=MU, nesterov=nesterov)

    def run(self, steps: range) -> None:
        for step in steps:
            _inner_step(self.layout, self.replicas, self.opts, step)
            if (step + 1) % H:
                continue
            theta = {dc: dict(m.named_parameters()) for dc, m in self.replicas.items()}
            with torch.no_grad():
                for n, a in self.anchor.items():
                    a.grad = torch.stack([a - theta[dc][n] for dc in self.layout.dcs]).mean(0)
                self.outer.step()
                for dc in self.layout.dcs:
                    for n, a in self.anchor.items():
                        theta[dc][n].copy_(a)

    def resize(self, dcs: tuple[str, ...]) -> None:
        """A new set of DCs, every one resuming from the first old DC's replica and inner state (as the elastic
        trainer does); the outer parameters and momentum carry on."""
        keep, keep_opt = self.replicas[self.layout.dcs[0]], self.opts[self.layout.dcs[0]]
        self.layout = DCLayout(dcs)
        self.replicas = {}
        self.opts = {}
        for dc in self.layout.dcs:
            m = odd_model()
            m.load_state_dict(keep.state_dict())
            opt = build_adamw(m, OPTIM)
            opt.load_state_dict(copy.deepcopy(keep_opt.state_dict()))  # torch would share the moment tensors
            self.replicas[dc], self.opts[dc] = m, opt

    def params(self) -> dict[str, dict[str, torch.Tensor]]:
        return {dc: params_of(m) for dc, m in self.replicas.items()}

    def momentum(self) -> dict[str, torch.Tensor]:
        return {n: self.outer.state[a]["momentum_buffer"] for n, a in self.anchor.items()}


def _assert_close(params, ref) -> None:
    for name, t in params.items():
        torch.testing.assert_close(t, ref[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_momentum_step_is_torch_sgd_on_the_mean_delta(nesterov):
    dcs = ("a", "a", "b")
    steps = 2 * H + 1  # two outer steps (momentum matters on the second), then one inner step apart
    out = run_processes(_plain, len(dcs), dcs, nesterov, steps)
    ref = Reference(dcs, nesterov)
    ref.run(range(steps))
    expected = ref.params()
    for rank, (params, _) in enumerate(out):
        _assert_close(params, expected[dcs[rank]])
        assert params["frozen"].equal(odd_model().frozen)  # never trained, never moved by the outer step
    outer = out[0][1]
    _assert_close({n: t.reshape(-1) for n, t in outer["anchor"].items()}, {n: a.reshape(-1) for n, a in ref.anchor.items()})
    _assert_close({n: t.reshape(-1) for n, t in outer["momentum"].items()},
                  {n: m.reshape(-1) for n, m in ref.momentum().items()})  # fmt: skip
    assert "frozen" not in outer["anchor"] and "empty" not in outer["anchor"]  # neither trains: no outer state


def _before_resize(rank, world, dcs):
    e = _engine(rank, dcs, True)
    train_steps(e, rank, world, steps=H, micro=2)  # one outer step: every DC now holds the outer parameters
    e.synchronize()
    out = params_of(e.model), e.optimizer_state()
    _close(e)
    return out


def _after_resize(rank, world, dcs, params, optimizer):
    e = _engine(rank, dcs, True)
    e.synchronize()
    e.load_weights(e.model, params)
    e.load_optimizer_state(optimizer)
    train_steps(e, rank, world, steps=H, micro=2, first_step=H)
    e.synchronize()
    out = params_of(e.model)
    _close(e)
    return out


def test_a_change_in_the_number_of_datacenters_averages_over_the_new_ones_and_keeps_the_momentum():
    before, after = ("a", "b", "c"), ("a", "a", "b")
    old = run_processes(_before_resize, len(before), before)
    params, optimizer = old[0]  # DC a's rank 0: its full inner state and the outer state
    new = run_processes(_after_resize, len(after), after, params, optimizer)
    ref = Reference(before, nesterov=True)
    ref.run(range(H))
    _assert_close(params, ref.params()["a"])
    ref.resize(after)
    ref.run(range(H, 2 * H))
    expected = ref.params()
    for rank, got in enumerate(new):
        _assert_close(got, expected[after[rank]])
    # Without the carried momentum the second outer step lands elsewhere: the comparison above sees it.
    fresh = Reference(before, nesterov=True)
    fresh.run(range(H))
    fresh.resize(after)
    fresh.outer.state.clear()
    fresh.run(range(H, 2 * H))
    assert any(not torch.allclose(new[0][n], fresh.params()["a"][n], rtol=1e-4, atol=1e-5) for n in new[0])


# -- the fragment schedule ----------------------------------------------------------------------------------


def test_schedule_syncs_every_fragment_once_per_cycle_and_lands_it_before_its_next_sync():
    for h, p, tau, k in itertools.product(range(1, 13), range(1, 13), range(12), range(3)):
        if p > h or tau >= h:
            continue
        c = warmup_cycle(h, p, tau)
        if k and c > h:
            continue
        s = FragmentSchedule(h, p, tau, k * c)
        w = k * c
        end = w + 3 * h + tau + 1
        for f in range(p):
            starts = [t for t in range(1, end) if f in s.starting(t)]
            lands = [t for t in range(1, end) if f in s.landing(t)]
            assert lands == [t + tau for t in starts if t + tau < end], (h, p, tau, w, f)
            assert all(b - a > tau for a, b in itertools.pairwise(starts)), (h, p, tau, w, f)  # not while in flight
            warm, main = [t for t in starts if t <= w], [t for t in starts if t > w]
            assert len(warm) == k, (h, p, tau, w, f)  # once per short cycle during the warm-up
            assert all(b - a == h for a, b in itertools.pairwise(main)), (h, p, tau, w, f)
            assert main and main[0] - (warm[-1] if warm else 0) <= h, (h, p, tau, w, f)


def test_fragments_are_contiguous_non_empty_and_cover_every_bucket():
    g = torch.Generator().manual_seed(0)
    for _ in range(2000):
        n = int(torch.randint(1, 9, (1,), generator=g))
        sizes = [int(s) for s in torch.tensor([1, 2, 5, 100, 1000])[torch.randint(0, 5, (n,), generator=g)]]
        f = int(torch.randint(1, n + 1, (1,), generator=g))
        frags = split_fragments(sizes, f)
        assert len(frags) == f and all(frags) and [b for fr in frags for b in fr] == list(range(n)), (sizes, f)


# -- codecs: empty chunks and bf16 input ------------------------------------------------------------------------


@pytest.mark.parametrize("codec", [Int8Codec(), Int4Codec(), Bf16Codec()], ids=["int8", "int4", "bf16"])
def test_codecs_take_empty_chunks_and_keep_fp32_residuals_of_bf16_input(codec):
    assert codec.decode(codec.encode(torch.zeros(0))).numel() == 0
    feedback = ErrorFeedback(codec)
    g = torch.Generator().manual_seed(1)
    true, sent = torch.zeros(300, dtype=torch.float64), torch.zeros(300, dtype=torch.float64)
    for _ in range(50):
        x = torch.randn(300, generator=g).to(torch.bfloat16)
        true += x.double()
        sent += codec.decode(feedback.encode("k", x)).double()
    residual = feedback.residuals["k"]
    assert residual.dtype == torch.float32
    torch.testing.assert_close(sent + residual.double(), true, rtol=0, atol=1e-5)  # Σ sent = Σ x − residual


def test_error_feedback_of_many_datacenters_sums_to_the_exact_total():
    """k DCs each encode their own stream with feedback and the receivers decode and sum in fp32 (int8 / int4):
    over the steps the decoded sums add up to the true sums minus the k final residuals."""
    g = torch.Generator().manual_seed(2)
    for codec in (Int8Codec(), Int4Codec()):
        feedback = [ErrorFeedback(codec) for _ in range(3)]
        true, sent = torch.zeros(257, dtype=torch.float64), torch.zeros(257, dtype=torch.float64)
        for step in range(100):
            xs = [torch.randn(257, generator=g) * (1 + step % 5) for _ in feedback]
            true += sum(x.double() for x in xs)
            rows = torch.stack([fb.encode("k", x) for fb, x in zip(feedback, xs, strict=True)])
            sent += codec.decode_sum(rows).double()
        left = sum(fb.residuals["k"].double() for fb in feedback)
        torch.testing.assert_close(sent + left, true, rtol=0, atol=1e-3)
