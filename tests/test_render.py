"""What the CLI prints for a job that ended: the summary reads every result a job can have."""

from __future__ import annotations

from meridian.cli.render import summary


def job(**result):
    base = {"first_loss": 5.6, "final_loss": 2.7, "eval_loss": 2.6, "tokens_per_s": 1.2e4, "steps": 60,
            "inter_dc_bytes_per_step": 7e6}
    return {"id": "abc", "name": "demo", "state": "succeeded", "message": "done", "progress": {}, "placement": [],
            "result": {**base, **result}}


def test_the_summary_shows_the_held_out_loss_or_why_there_is_none():
    assert "5.600 → 2.700 (held-out 2.600)" in summary(job())
    # A job whose held-out split is too small for one sample ends with no held-out loss (it formatted None: crash)
    why = "the held-out split has 0 tokens, too few for one sample"
    assert f"5.600 → 2.700 (no held-out loss: {why})" in summary(job(eval_loss=None, eval_skipped=why))


def test_the_summary_of_a_result_without_losses_says_so_instead_of_failing():
    # A result whose losses are null (NaN from workers whose last epoch trained no step) made `meridian run` raise.
    assert "loss            - → - (held-out 2.600)" in summary(job(first_loss=None, final_loss=None))


def test_the_summary_says_what_an_armed_look_ahead_decided():
    decided = "Sync at epoch 1: exact sync kept: the exact sync left 1.0 ms a step exposed (1% of 100.0 ms ...)."
    assert f"  sync decided    {decided}" in summary(job(), sync_decisions=(decided,)).splitlines()
    assert "sync decided" not in summary(job())
