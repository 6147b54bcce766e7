"""A reward that ignores the completion: the --reward_file of tests that measure the update, not learning.

A random-weight model's completions carry no signal for a content reward: the Qwen2.5-0.5B-shaped model of
tests/test_gpu.py samples ids from 151,936 of which the tiny tokenizer knows 561, so ~80% of its completions
decode to "" and a reward on the text (its length, say) ties in ~40% of groups of 4. Tied groups are dropped,
and a step with none left takes no update. Noise differs within every group, so every step updates.
"""
import random

from simple_grpo.task.rewards import reward_function

rng = random.Random(0)  # the same rewards in the same order, run after run


@reward_function("noise")
def noise(completion, answer):
    return rng.random()
