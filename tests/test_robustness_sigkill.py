"""SIGKILL at chosen points of a real ``dporl train`` (checkpoint and journal writes, the window between a journal
record and its chain head, inside a training step, inside the release), then ``--resume``: the run never
under-counts and never loses a paid step. ``python -m dporl.audit --sigkill 30`` runs the same checks at random
points."""

from __future__ import annotations

from dporl.audit.crash_resume import audit


def test_sigkills_at_chosen_points_never_under_count_or_lose_a_paid_step(tmp_path):
    result = audit(work_dir=tmp_path, progress=False, plan=[
        # the step-20 checkpoint's rename; the second journal record of the resumed run, before its head; step 47
        (100, ["before:last.pt:2", "after:journal.json:2", "step:47"]),
        (60, ["after:release.json:1"]),  # the release written whole, not yet marked complete: reused
        (60, ["after:d_stable.npz:1"]),  # inside the release (charged, not whole): refused by name, never re-run
    ])
    assert result["kills"] == 5, result["kill_details"]
    assert result["failures"] == [] and result["passed"]
    assert result["write_ahead_violations"] == result["under_counts"] == result["paid_steps_lost"] == 0
    assert result["replay_mismatches"] == result["repeated_releases"] == 0
    first, reused, refused = result["trial_details"]
    assert first["outcome"] == reused["outcome"] == "finished" and refused["outcome"] == "refused (release interrupted)"
    assert first["trained"] == first["charged"] == 100 and reused["trained"] == 60
    # The first run's kills landed where they were aimed: at step 20's block boundary, then mid-block.
    kills = [k for k in result["kill_details"] if k["trial"] == 0]
    assert [k["began"] for k in kills] == [20, 40, 47] and [k["charged"] for k in kills] == [20, 60, 60]
