"""Rewards that give a weak pretrained model some signal (the SmolLM2 tests' --reward_file).

SmolLM2-135M never writes the <answer> tags the default rewards look for, so every group scores
alike and GRPO learns nothing. These two score what it does write: whether the right number appears
anywhere in the completion, and how short it is.
"""
import re

from simple_grpo.task.rewards import reward_function


@reward_function("mentions_answer")
def mentions_answer(completion, answer):
    """answer: the true answer, as the training rewards get it."""
    return float(answer in re.findall(r"-?\d+", completion.replace(",", "")))


@reward_function("brevity")
def brevity(completion, answer):
    return max(0.0, 1.0 - len(completion) / 200)
