"""The trainer for the regrouping reference server: the full trainer (simple_grpo/train.py) with --regroup.

    python regroup_ver/ref_server_regroup.py &     # pools answers, serves groups with mixed rewards
    python regroup_ver/grpo_regroup.py             # tiny default; every flag of simple_grpo.train works

The server forms the groups: give it the trainer's --scale_rewards, --advantage_eps and --prompt_format
too (an upload made with others is refused, naming the flag; README.md here).

The vLLM worker uploads every group, all-alike ones too, and asks such a question once more in
its next batch when its answers differ among themselves; the trainer takes batch_prompts served
groups per step, and reports its policy version so the server serves no answer more than its
--max_policy_lag older.

This file runs `python -m simple_grpo.train` in its own process (exec: same process id, environment, the repository
on PYTHONPATH, and launcher), with --regroup and runs/regroup/ as defaults that flags given here override.
"""
import os
import sys

if __name__ == "__main__":
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where the package simple_grpo/ is
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    os.execve(sys.executable, [sys.executable, "-m", "simple_grpo.train", "--regroup", "--run_name", "regroup",
                               *sys.argv[1:]], env)
