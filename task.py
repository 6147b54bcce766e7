"""What a run learns from, the flags every script shares: the model, the problems, the reward, and
how completions are sampled. grpo_train.Config, tools/probe.py and tools/explain_step.py extend it."""
from dataclasses import dataclass

from flags import flag


@dataclass
class TaskConfig:
    model: str = flag("models/tiny-math", "the policy's starting point: an HF model directory or hub name")
    dataset: str = flag("data/toy_math/train.jsonl", "problems: a .jsonl/.json/.parquet/.csv file or a hub dataset")
    dataset_config: str = flag("", "a hub dataset's config, e.g. main for openai/gsm8k")
    split: str = flag("train", "a hub dataset's split")
    question_field: str = flag("question", "the field holding the question")
    answer_field: str = flag("answer", 'the field holding the "... #### N" answer')
    prompt_format: str = flag("chat", "chat: the model's chat template; raw: plain text (base models without one)")
    reward_funcs: str = flag("correctness,format", "reward functions (rewards.REWARD_FUNCS); reward = weighted sum")
    reward_weights: str = flag("1.0,0.5", "one weight per reward function")
    reward_file: str = flag("", "a .py file whose @reward_function-decorated functions add rewards")
    num_generations: int = flag(8, "completions per problem: the group size G")
    max_new_tokens: int = flag(48, "the longest completion, in tokens")
    min_new_tokens: int = flag(0, "no stop token before this many tokens (benchmarks at a fixed length)")
    temperature: float = flag(0.7, "sampling temperature; the log-probs are of the same distribution")
    seed: int = flag(0, "seed of the problem draws and the sampling")
