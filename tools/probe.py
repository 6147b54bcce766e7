"""Pre-flight probe: will GRPO get a learning signal from this model, data and reward?

    python tools/probe.py                                    # tiny model, toy task, 200 problems x 8
    python tools/probe.py --model .cache/models/SmolLM2-135M-Instruct --n 16 --num_generations 4
    python tools/probe.py --reward_file my_rewards.py --reward_funcs correctness,mine --reward_weights 1,0.5
    python tools/probe.py --log_completions runs/probe/completions.jsonl   # then tools/view_run.py

Samples G completions for each of the first n problems with the STARTING model (vLLM, as grpo_vllm_one.py
samples), scores them with the training rewards, and prints how many prompts had 0, 1, ..., G correct
completions, the reward spread within each group, the format rate, the completion length, the share cut off,
the share of groups whose rewards are all alike (GRPO learns nothing from them), a verdict in plain words, and
one last JSON line. The probe itself: simple_grpo/run/probe.py (the trainers' --preflight runs it too).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# noqa: E402 below - these imports come after the path fix that lets the script import them
from simple_grpo.flags import parse_flags  # noqa: E402
from simple_grpo.run.probe import ProbeConfig, probe  # noqa: E402

if __name__ == "__main__":
    probe(parse_flags(ProbeConfig, __doc__))
