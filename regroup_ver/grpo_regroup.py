"""The trainer for the regrouping reference server: grpo_vllm_one.py with --regroup.

    python regroup_ver/ref_server_regroup.py &     # pools answers, serves groups with mixed rewards
    python regroup_ver/grpo_regroup.py             # tiny default; every flag of grpo_vllm_one.py works

The server forms the groups: give it the trainer's --scale_rewards, --advantage_eps and --prompt_format
too (an upload made with others is refused, naming the flag; README.md here).

The vLLM worker uploads every group, all-alike ones too, and asks such a question once more in
its next batch when its answers differ among themselves; the trainer takes batch_prompts served
groups per step, and reports its policy version so the server serves no answer more than its
--max_policy_lag older.

This file runs grpo_vllm_one.py in its own process (exec: same process id, environment and
launcher), with --regroup and runs/regroup/ as defaults that flags given here override.
"""
import os
import sys

if __name__ == "__main__":
    trainer = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "grpo_vllm_one.py")
    os.execv(sys.executable, [sys.executable, trainer, "--regroup", "--run_name", "regroup", *sys.argv[1:]])
