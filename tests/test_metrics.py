"""metrics.jsonl keeps every figure's significant digits: small learning rates and KLs are not logged as 0.
A step with no update logs its update's figures as null, and the curves and the report leave it out."""
import json

from simple_grpo.run.metrics import curves_png, log_step
from simple_grpo.run.report import first_last_table


def test_small_figures_keep_their_significant_digits(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log_step(str(path), {"step": 1, "lr": 1e-6, "kl": 3.14159265e-7, "reward_mean": 0.123456789, "tokens": 12})
    row = json.loads(path.read_text())
    assert row == {"step": 1, "lr": 1e-6, "kl": 3.14159e-7, "reward_mean": 0.123457, "tokens": 12}


def test_a_figure_not_measured_is_logged_as_null(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log_step(str(path), {"step": 1, "kl": None, "loss": None, "grad_norm": None, "reward_mean": 0.0})
    assert json.loads(path.read_text()) == {"step": 1, "kl": None, "loss": None, "grad_norm": None, "reward_mean": 0.0}


def test_a_curve_leaves_out_the_steps_that_did_not_measure_it():
    rows = [{"step": 1, "kl": None, "reward_mean": 0.0}, {"step": 2, "kl": 0.2, "reward_mean": 0.5}]
    assert curves_png(rows, ["kl", "reward_mean"]).startswith(b"\x89PNG")
    assert curves_png([rows[0]], ["kl"]) is None  # a curve with no measured point is not drawn, not drawn at 0


def test_the_reports_first_and_last_values_skip_steps_that_did_not_measure_them():
    rows = [{"step": s, "kl": kl} for s, kl in ((1, None), (2, 0.2), (3, 0.4), (4, None))]
    assert "<tr><th>first step</th><td>0.2</td></tr><tr><th>last step</th><td>0.4</td></tr>" in first_last_table(rows)
