"""``meridian bench lowcomm`` at toy size: the harness measures what it claims, and torchft's DiLoCo, run on the
same model, data, seed and steps, lands where Meridian's fp32 DiLoCo does (the same algorithm: a check that
the comparison is like for like). Tolerances: same-algorithm validation losses within 0.5% (measured: equal
to 4–5 digits; summation order differs: torchft all-reduces per parameter, Meridian per bucket shard)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchft")

from meridian.bench.lowcomm import run  # noqa: E402
from meridian.bench.sync import count_params  # noqa: E402
from meridian.cli.bench import build_parser  # noqa: E402

H = 4


@pytest.mark.slow
def test_torchft_and_meridian_diloco_agree_and_bytes_are_what_was_sent():
    args = build_parser().parse_args(
        ["lowcomm", "--steps", "16", "--inner-steps", str(H), "--compression", "none", "int4", "--rtt-ms", "10",
         "--inter-dc-gbps", "1", "--val-batches", "2", "--warmup-steps", "2", "--fragments", "2", "--overlap-steps", "1", "--diloco-warmup-steps", "0",
         "--final-average", "off", "fp32",
         "--strategies", f"diloco+none/H{H}", f"diloco+int4/H{H}", f"torchft-diloco/H{H}", f"diloco+none/H{H}/avg-fp32"]
    )  # fmt: skip
    out = run(args)
    # the built-in text, and how many times the strategies read its training part
    assert out["data"]["source"] == "builtin:python-reference"
    assert out["data"]["epochs"] == round(16 * 64 * 64 / out["data"]["train_tokens"], 2)
    rows = out["strategies"]
    assert list(rows) == ["har", f"diloco+none/H{H}", f"diloco+none/H{H}/avg-fp32", f"diloco+int4/H{H}",
                          f"torchft-diloco/H{H}"]
    params = count_params("nano")
    # per-step sync: both DCs send their whole fp32 gradient every step, as counted at the collective
    assert rows["har"]["inter_dc_bytes_per_step"] == 2 * 4 * params
    mine, ft = rows[f"diloco+none/H{H}"], rows[f"torchft-diloco/H{H}"]
    assert mine["inter_dc_bytes_per_step"] == ft["inter_dc_bytes_per_step"] == 2 * 4 * params / H
    assert mine["bytes_reduction_vs_har"] == H and ft["commits"] == 16 // H
    assert mine["final_val_loss"] == pytest.approx(ft["final_val_loss"], rel=5e-3)
    # the last step's average replaces that step's outer sync: the same fp32 rows cross, once, and what lands differs
    # (the mean of the datacenters, not an outer Nesterov step on it)
    averaged = rows[f"diloco+none/H{H}/avg-fp32"]
    assert averaged["final_average"] == "fp32" and mine["final_average"] == "off"
    assert averaged["inter_dc_bytes_per_step"] == mine["inter_dc_bytes_per_step"]
    assert averaged["final_val_loss"] != mine["final_val_loss"]
    int4 = rows[f"diloco+int4/H{H}"]
    assert 7 <= mine["inter_dc_bytes_per_step"] / int4["inter_dc_bytes_per_step"] <= 8  # 0.53 of 4 bytes
    for r in rows.values():
        assert 0 < r["compute_utilisation"] <= 1 and r["wall_s"] > 0
        # every rank's own figure (both sides: torchft's ranks too); the job's lies between them
        per_rank = r["compute_utilisation_per_rank"]
        assert len(per_rank) == 2 and all(0 < u <= 1 for u in per_rank)
        assert min(per_rank) - 1e-4 <= r["compute_utilisation"] <= max(per_rank) + 1e-4
    assert out["auto_choice"]["strategy"] in ("hierarchical", "diloco", "streaming-diloco")
    assert out["auto_choice"]["reason"]


def test_the_default_overlap_is_autos_rule_for_the_link_and_a_step_measured_here(tmp_path):
    from meridian.bench import corpus
    from meridian.bench.lowcomm import overlap_rule, overlap_steps
    from meridian.service.planning.sync_choice import cross_dc_time, max_overlap_steps, overlap_steps_for

    args = build_parser().parse_args(["lowcomm", "--inner-steps", "8", "--compression", "int8", "int4"])
    args.corpus = corpus.prepare(args.data_source, args.data_max_bytes, str(tmp_path))
    params = count_params("nano")
    rule = overlap_rule(args, params)
    assert 0 < rule["compute_s_probe"] < 1
    # the largest fragment the chosen encodings send: int8's byte per parameter, a quarter of the model each
    assert rule["fragment_sync_s"] == pytest.approx(
        cross_dc_time(params / 4, rtt_ms=100, gbps=0.1, num_dcs=2), rel=1e-3)
    assert rule["overlap_steps"] == overlap_steps_for(rule["fragment_sync_s"], rule["compute_s_probe"])
    args.overlap_rule = rule
    assert overlap_steps(args, 8) == min(rule["overlap_steps"], max_overlap_steps(8)) <= 8 // 3
    args.overlap_steps = 5  # given: kept, under H
    assert overlap_steps(args, 8) == 5 and overlap_steps(args, 4) == 3
