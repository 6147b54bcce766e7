"""A reward no completion ever earns: the no-signal tests' --reward_file (every group scores all 0)."""
from simple_grpo.task.rewards import reward_function


@reward_function("never")
def never(completion, answer):
    return 0.0
