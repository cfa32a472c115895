"""AdamW under the hierarchical engine (FSDP2 inside each datacenter) reproduces plain AdamW, holds a datacenter's
share of the state on each rank, and checkpoints anywhere.

Multi-process runs on real gloo groups train a toy model (odd-sized parameters in both weight-decay groups,
one parameter smaller than the rank count) with gradient clipping active and 2 accumulated micro-batches,
and compare with a plain single-process ``torch.optim.AdamW`` run in the test process. Which rows each rank
holds, for datacenters of any sizes, is pure arithmetic (``tests/test_shard_rows.py``).
"""

from __future__ import annotations

import pytest
import torch
from sync_helpers import (
    max_rel_diff,
    params_of,
    reference_bf16_master,
    reference_params,
    toy_model,
    train_steps,
)
from torch.distributed.fsdp import MixedPrecisionPolicy

from meridian.workers.contracts.config import OptimConfig, SyncConfig
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.model.gpt import GPT
from meridian.workers.parallel.fsdp import apply_fsdp, dc_mesh
from meridian.workers.sync.build import build_sync
from meridian.workers.sync.fsdp_har import FSDPHierarchicalSync

# Clipping is active on every step of the toy run (gradient norms 4–8 against 0.5; clipping moves the
# final parameters by 27% of their size, so the tolerances below are far from vacuous).
OPTIM = OptimConfig(lr=0.05, weight_decay=0.1, grad_clip=0.5, warmup_steps=0)
STEPS, MICRO = 4, 2
# fp32 summation order differs (HAR vs one process), and Adam divides by sqrt(v): a few ulps of gradient
# become ~1e-7 of a parameter after a few steps.
FP32_TOL = 1e-5


def _groups(rank, dcs):
    return DCGroups(DCLayout(dcs), rank, segment_groups=False)


def _engine(rank, dcs, *, overlap=False):
    sync = SyncConfig(overlap=overlap, inter_dc_chunk_mb=40 / 2**20)
    return build_sync(toy_model(0), _groups(rank, dcs), sync, OPTIM)


def _finish(engine):
    engine.synchronize()
    out = params_of(engine.model)
    engine.close()
    engine.groups.destroy()
    return out


def _nano_state_bytes(rank, dcs):
    torch.manual_seed(0)
    engine = build_sync(GPT(model_preset("nano")), _groups(rank, dcs), SyncConfig(), OPTIM)
    x = torch.randint(0, 256, (1, 16))
    engine.backward(engine.model(x).float().square().mean(), last_micro_batch=True)
    engine.step(1e-3)
    nbytes = engine.optimizer_state_nbytes()
    _finish(engine)
    return nbytes


def _even_run(rank, world, dcs):
    """2 + 2: against the reference (clipping), the state each rank holds, a gathered checkpoint."""
    out = {"init": params_of(toy_model(0))}
    e = _engine(rank, dcs)
    out["norms"] = [s.grad_norm for s in train_steps(e, rank, world, STEPS, MICRO)]
    out["full_state"] = e.optimizer_state()
    out["ranges"] = e.owned_ranges()
    out["sharded"] = _finish(e)
    out["nano_bytes"] = _nano_state_bytes(rank, dcs)
    return out


def _bf16_engine(rank, dcs):
    """FSDP2's mixed precision, as a bf16 job runs: fp32 parameter shards (what AdamW steps), bf16 for compute."""
    groups = _groups(rank, dcs)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def shard(model, reduce_scatter):
        return apply_fsdp(model, dc_mesh(groups.intra_dc, torch.device("cpu")), mp_policy=policy,
                          reduce_scatter=reduce_scatter)

    return FSDPHierarchicalSync(toy_model(0), groups, SyncConfig(inter_dc_chunk_mb=40 / 2**20), OPTIM, shard=shard)


def _uneven_run(rank, world, dcs, checkpoint):
    """2 + 1: a fresh run, bf16 compute on fp32 parameters, and resuming a 2 + 2 checkpoint."""
    out = {}
    e = _engine(rank, dcs)
    train_steps(e, rank, world, STEPS, MICRO)
    out["sharded"] = _finish(e)
    e = _bf16_engine(rank, dcs)
    train_steps(e, rank, world, STEPS, MICRO, dtype=torch.bfloat16)
    out["bf16_nbytes"] = e.optimizer_state_nbytes()
    out["bf16"] = _finish(e)
    e = _engine(rank, dcs)
    e.load_weights(e.model, checkpoint["model"])
    e.load_optimizer_state(checkpoint["optimizer"])
    train_steps(e, rank, world, STEPS, MICRO, first_step=STEPS)
    out["resumed"] = _finish(e)
    return out


@pytest.fixture(scope="module")
def even():
    return run_processes(_even_run, 4, ("a", "a", "b", "b"), timeout_s=240)


def test_sharded_adamw_matches_single_process_adamw_even_layout(even):
    ref = reference_params(STEPS, OPTIM)
    for rank, out in enumerate(even):
        assert max_rel_diff(out["sharded"], ref) < FP32_TOL, rank
        assert all(n > OPTIM.grad_clip for n in out["norms"])  # clipping really was on
        # Every parameter element moved: no row was left without an owner.
        for name, p in out["sharded"].items():
            assert (p != out["init"][name]).all(), (rank, name)
        # Replicas agree bit for bit, across both DCs.
        for name, p in out["sharded"].items():
            assert torch.equal(p, even[0]["sharded"][name]), (rank, name)


def test_optimizer_state_is_one_nth_per_rank(even):
    n_params = model_preset("nano").num_params
    whole = 2 * 4 * n_params  # exp_avg + exp_avg_sq, fp32: what one rank alone (or flat sync) holds
    for dc_ranks in ((0, 1), (2, 3)):  # N = 2 ranks per DC: each holds about half, together one copy
        assert sum(even[r]["nano_bytes"] for r in dc_ranks) == pytest.approx(whole, rel=1e-3)
        assert all(even[r]["nano_bytes"] == pytest.approx(whole / 2, rel=0.05) for r in dc_ranks)
    # The ranges of one DC partition every parameter exactly once.
    for dc_ranks in ((0, 1), (2, 3)):
        covered = {n: torch.zeros(p.numel(), dtype=torch.int32) for n, p in even[0]["init"].items()}
        for r in dc_ranks:
            for name, a, b in even[r]["ranges"]:
                covered[name][a:b] += 1
        assert all((c == 1).all() for c in covered.values())


def test_full_state_is_the_same_on_every_rank_and_unsharded(even):
    state = even[0]["full_state"]
    assert state["step"] == STEPS and set(state["params"]) == set(even[0]["init"])
    for name, p in even[0]["init"].items():
        assert state["params"][name]["exp_avg"].shape == p.shape
    for out in even[1:]:
        for name, moments in out["full_state"]["params"].items():
            for m, t in moments.items():
                assert torch.equal(t, state["params"][name][m]), (name, m)


@pytest.fixture(scope="module")
def uneven(even):
    checkpoint = {"model": even[0]["sharded"], "optimizer": even[0]["full_state"]}
    return run_processes(_uneven_run, 3, ("a", "a", "b"), checkpoint, timeout_s=240)


def test_sharded_adamw_matches_single_process_adamw_uneven_layout(uneven):
    ref = reference_params(STEPS, OPTIM)
    init = params_of(toy_model(0))
    for out in uneven:
        assert max_rel_diff(out["sharded"], ref) < FP32_TOL
        for name, p in out["sharded"].items():
            assert (p != init[name]).all(), name
            assert torch.equal(p, uneven[0]["sharded"][name]), name


def test_checkpoint_from_2_plus_2_resumes_on_2_plus_1(uneven):
    # 4 steps on 2 + 2, full state gathered, loaded into 2 + 1, 4 more: the 8-step single-process run.
    ref = reference_params(2 * STEPS, OPTIM)
    for out in uneven:
        assert max_rel_diff(out["resumed"], ref) < FP32_TOL


def test_bf16_compute_steps_fp32_parameters(uneven):
    ref = reference_bf16_master(STEPS, OPTIM)
    for out in uneven:
        # fp32 parameters follow a hand-written fp32-master AdamW on bf16 gradients; bf16 gradients summed in
        # another order differ by bf16 ulps (2^-8), so they agree to ~1e-2 of the largest value.
        assert max_rel_diff(out["bf16"], ref) < 1e-2
        for name, p in out["bf16"].items():
            assert p.dtype == torch.float32, name
            assert torch.equal(p, uneven[0]["bf16"][name]), name
    # Moments (8 B) per element of a datacenter's share: ranks 0, 1 share DC "a", rank 2 is alone.
    numel = sum(p.numel() for p in ref.values())
    assert uneven[2]["bf16_nbytes"] >= 8 * numel
    assert uneven[0]["bf16_nbytes"] + uneven[1]["bf16_nbytes"] == pytest.approx(uneven[2]["bf16_nbytes"], rel=0.1)


def _uneven_3_plus_2(rank, world):
    e = _engine(rank, ("a", "a", "a", "b", "b"), overlap=True)
    train_steps(e, rank, world, STEPS, MICRO)
    return _finish(e)


@pytest.mark.slow
def test_sharded_overlapped_3_plus_2():
    ref = reference_params(STEPS, OPTIM)
    for out in run_processes(_uneven_3_plus_2, 5, timeout_s=240):
        assert max_rel_diff(out, ref) < FP32_TOL
