"""The trainer for the regrouping reference server: grpo_vllm_one.py with --regroup.

    python regroup_ver/ref_server_regroup.py &     # pools answers, serves groups with mixed rewards
    python regroup_ver/grpo_regroup.py             # tiny default; every flag of grpo_vllm_one.py works

The vLLM worker uploads every group, all-alike ones too, and asks such a question once more in
its next batch when its answers differ among themselves; the trainer takes batch_prompts served
groups per step, and reports its policy version so the server serves no answer more than its
--max_policy_lag older.
"""
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the main code, one level up
from flags import flag, parse_flags  # noqa: E402
from grpo_vllm_one import Config, main  # noqa: E402


@dataclass
class RegroupConfig(Config):
    run_name: str = flag("regroup", "outputs go to runs/RUN_NAME/")
    regroup: bool = flag(True, "upload all groups; the regrouping server serves mixed-reward ones")


if __name__ == "__main__":
    main(parse_flags(RegroupConfig, __doc__))
