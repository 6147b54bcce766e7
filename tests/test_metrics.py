"""metrics.jsonl keeps every figure's significant digits: small learning rates and KLs are not logged as 0."""
import json

from simple_grpo.run.metrics import log_step


def test_small_figures_keep_their_significant_digits(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log_step(str(path), {"step": 1, "lr": 1e-6, "kl": 3.14159265e-7, "reward_mean": 0.123456789, "tokens": 12})
    row = json.loads(path.read_text())
    assert row == {"step": 1, "lr": 1e-6, "kl": 3.14159e-7, "reward_mean": 0.123457, "tokens": 12}
