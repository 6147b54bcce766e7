"""--advantage_eps, the trainers' flag (simple_grpo/trainer/config.py), moves the advantages: a group's are
(r - mean) / (std + eps), so where its rewards barely differ (std 0.001) eps 1e-4 -> 0.01 makes them 10x smaller,
and where they differ by a reward step (std ~0.5) a few percent. Shown through the flag parser and the full trainer's
make_groups (fast), and through a real step of grpo_train.py, whose completions log holds the advantages it trained
on (slow). (The regrouping server's own --advantage_eps: tests/test_regroup.py.)"""
import os
import subprocess
import sys

import pytest
import torch

from grpo_math import completion_mask
from simple_grpo.flags import parse_flags
from simple_grpo.rollouts import make_groups
from simple_grpo.run.checkpoints import runs_root
from simple_grpo.run.completions_log import read_completions
from simple_grpo.trainer.config import check_options
from tests.test_faults import fresh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def expected(rewards, G, eps):
    """GRPO's advantages written out: each group's (r - mean) / (std + eps), std the unbiased one (torch's)."""
    r = rewards.view(-1, G)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).flatten()


def test_the_fast_trainers_groups_get_advantages_that_follow_advantage_eps():
    from simple_grpo.train import Config
    Q, G, C, STOP = 2, 4, 5, 2  # STOP: the tiny model's <|im_end|>
    rewards = torch.tensor([0.5, 0.5, 0.5, 0.502,  # std 0.001: eps decides the scale
                            1.5, 0.0, 1.5, 0.0])  # std 0.87: eps barely matters
    completion_ids = torch.full((Q * G, C), 7)
    completion_ids[:, -1] = STOP
    prompt_rows = [torch.tensor([5, 6, q]) for q in range(Q)]

    def advantages(*flags):
        cfg = parse_flags(Config, args=list(flags))  # simple_grpo/train.py's command line
        check_options(cfg)
        # the generation worker's call (simple_grpo/train.py's gen_worker: GRPO 2.)
        groups, _ = make_groups(prompt_rows, completion_ids, completion_mask(completion_ids, STOP), rewards, G, {},
                                keep_equal=cfg.regroup, scale_rewards=cfg.scale_rewards,
                                estimator=cfg.advantage_estimator, eps=cfg.advantage_eps)
        return torch.cat([tensors["advantages"] for tensors, _ in groups])

    default, wide = advantages(), advantages("--advantage_eps", "0.01")
    assert torch.allclose(default, expected(rewards, G, 1e-4)) and torch.allclose(wide, expected(rewards, G, 0.01))
    std = rewards.view(Q, G).std(1)
    shrink = ((std + 1e-4) / (std + 0.01)).repeat_interleave(G)  # how much eps 0.01 shrinks each group's
    assert torch.allclose(wide / default, shrink)
    assert abs(shrink[0] - 0.1) < 1e-3 and 0.98 < shrink[-1] < 0.99  # 0.0011 / 0.011; 0.8661 / 0.876


@pytest.mark.slow
def test_a_grpo_train_step_trains_on_advantages_that_follow_advantage_eps():
    logged = {}
    for i, eps in enumerate((1e-4, 1.0)):
        run = fresh(f"test_advantage_eps_{i}")
        out = subprocess.run([sys.executable, "grpo_train.py", "--steps", "1", "--beta", "0", "--batch_prompts", "2",
                              "--num_generations", "4", "--log_completions_every", "1", "--advantage_eps", str(eps),
                              "--run_name", run], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        logged[eps] = read_completions(os.path.join(runs_root(), run, "completions.jsonl"))  # one group with signal
    small, large = logged[1e-4], logged[1.0]
    assert [r["completion"] for r in small] == [r["completion"] for r in large]  # the same seed, the same samples
    rewards = torch.tensor([r["reward"] for r in small])
    G = len(rewards)
    assert rewards.std() > 0
    for eps, rows in logged.items():  # the log rounds to 5 decimals
        assert torch.allclose(torch.tensor([r["advantage"] for r in rows]), expected(rewards, G, eps), atol=2e-5)
    A_small, A_large = (torch.tensor([r["advantage"] for r in rows]) for rows in (small, large))
    moved = A_small != 0
    assert torch.allclose(A_large[moved] / A_small[moved], (rewards.std() + 1e-4) / (rewards.std() + 1.0), atol=1e-4)
