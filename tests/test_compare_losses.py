"""tools/compare_losses.py: the deviation arithmetic on known curves; a drifting run exits 1; bad input exits 2.
(Real runs through it, Litespark and stock megatron-core following the same curve: test_loss_equivalence.py.)"""
import json

import pytest

from conftest import load_tool, run_error

from litespark_megatron.apps.loss_curves import compare, smoothed


def write_metrics(path, losses, extra=()):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"kind": "run", "step": 0, "params": 1})]
    lines += [json.dumps({"kind": "train", "step": s, "loss": l}) for s, l in losses.items()]
    path.write_text("\n".join(lines + list(extra)) + "\n")
    return path


def test_deviation_arithmetic_and_a_drifting_run(tmp_path, capsys):
    assert smoothed([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]
    ref = {10: 4.0, 20: 3.0, 30: 2.0, 40: 2.0}
    drift = {10: 4.0, 20: 3.03, 30: 2.02, 40: 2.1, 50: 1.0}  # step 50: not in the reference, not compared
    c = compare(ref, drift, "drift", tolerance=0.02)
    assert c.steps == [10, 20, 30, 40] and c.deviations == pytest.approx([0.0, 0.01, 0.01, 0.05])
    assert (c.max_deviation, c.worst_step, c.within) == (pytest.approx(0.05), 40, False)
    assert c.mean_deviation == pytest.approx((0.0 + 0.01 + 0.01 + 0.05) / 4)       # all above: the signs add up
    lower = compare(ref, {10: 4.0, 20: 2.97, 30: 2.02, 40: 2.0}, "noise", tolerance=0.02)
    assert lower.mean_deviation == pytest.approx((-0.01 + 0.01) / 4) and lower.max_deviation == pytest.approx(0.01)
    c = compare(ref, drift, "drift", tolerance=0.02, smooth=2, start_step=20)
    assert c.steps == [20, 30, 40] and c.deviations[-1] == pytest.approx((2.06 - 2.0) / 2.0)  # means of (2.02, 2.1) and (2, 2)
    tool = load_tool("compare_losses")
    a = write_metrics(tmp_path / "ref" / "metrics.jsonl", ref)
    b = write_metrics(tmp_path / "drift" / "metrics.jsonl", drift)
    assert tool.main([str(a.parent), str(b), "--tolerance", "0.02"]) == 1
    out = capsys.readouterr().out
    assert "| drift | 4 (10-40) | 2.1000 / 2.0000 | 5.00% | 5.00% (40) | +1.75% | 2.00% | NO |" in out


@pytest.mark.parametrize("make, argv, message", [
    ("ok", ["{d}", "missing_dir"], "missing_dir does not exist"),
    ("empty", ["{d}", "{d}"], "is given twice"),
    ("empty", ["{d}"], "give at least two runs"),
    ("norecords", ["{d}", "{d2}"], "no train records with a loss"),
    ("badjson", ["{d}", "{d2}"], "line 2: not JSON"),
    ("disjoint", ["{d}", "{d2}"], "no logged step in common with the reference"),
    ("ok", ["{d}", "{d2}", "--start-step", "99"], "no common logged step at or after --start-step 99"),
    ("ok", ["{d}", "{d2}", "--tolerance", "2"], "argument --tolerance"),
])
def test_bad_input_is_one_line_and_exit_2(make, argv, message, tmp_path, capsys):
    d, d2 = tmp_path / "a", tmp_path / "b"
    if make == "empty":
        d.mkdir()
    elif make == "norecords":
        write_metrics(d / "metrics.jsonl", {})
        write_metrics(d2 / "metrics.jsonl", {1: 2.0})
    elif make == "badjson":
        d.mkdir()
        (d / "metrics.jsonl").write_text('{"kind": "run", "step": 0}\n{oops\n')
        write_metrics(d2 / "metrics.jsonl", {1: 2.0})
    elif make == "disjoint":
        write_metrics(d / "metrics.jsonl", {1: 2.0})
        write_metrics(d2 / "metrics.jsonl", {2: 2.0})
    elif make == "ok":
        write_metrics(d / "metrics.jsonl", {1: 2.0, 2: 1.9})
        write_metrics(d2 / "metrics.jsonl", {1: 2.0, 2: 1.9})
    args = [a.format(d=d, d2=d2) for a in argv]
    line = run_error(load_tool("compare_losses"), args, capsys)
    assert line.startswith("compare_losses: error: ") and message in line, line
