"""What a run learns from, the flags every script shares: the model, the problems, the reward, the sampling.
The trainers' TrainerConfig and the tools that sample extend TaskConfig; evaluate.py extends DataConfig."""
from dataclasses import dataclass

from simple_grpo.task.problems import SYSTEM_PROMPT, load_problems
from simple_grpo.flags import flag
from simple_grpo.task.rewards import load_reward_file, parse_reward_spec


TINY_MODEL = "models/tiny-math"  # the tiny default model (tools/build_tiny_model.py)


@dataclass
class DataConfig:
    """The model and its problems: what evaluate.py takes too."""
    model: str = flag(TINY_MODEL, "the policy's starting point: an HF model directory or hub name")
    dataset: str = flag("data/toy_math/train.jsonl", "problems: a .jsonl/.json/.parquet/.csv file or a hub dataset")
    dataset_config: str = flag("", "a hub dataset's config, e.g. main for openai/gsm8k")
    split: str = flag("train", "a hub dataset's split")
    question_field: str = flag("question", "the field holding the question")
    answer_field: str = flag("answer", 'the field holding the "... #### N" answer')
    prompt_format: str = flag("chat", "chat: the model's chat template; raw: plain text (base models without one)")
    system_prompt: str = flag(SYSTEM_PROMPT, "the system prompt (default: R1-Zero's; a short one suits a small model)")


@dataclass
class TaskConfig(DataConfig):
    """... and the reward and the sampling: what the trainers and the tools that sample take."""
    reward_funcs: str = flag("correctness,format", "reward functions (task/rewards.py), weighted and summed; the "
                             "logged accuracy is the first of correctness, answer_is among them (else correctness)")
    reward_weights: str = flag("1.0,0.5", "one weight per reward function")
    reward_file: str = flag("", "a .py file whose @reward_function-decorated functions add rewards")
    num_generations: int = flag(8, "completions per problem: the group size G")
    max_new_tokens: int = flag(48, "the longest completion, in tokens (evaluate.py's default is 64: see its --help)")
    min_new_tokens: int = flag(0, "no stop token before this many tokens (benchmarks at a fixed length)")
    temperature: float = flag(0.7, "sampling temperature: tokens come from softmax(logits / T), no top-k, top-p or "
                                   "penalty (nor the model's generation_config); the log-probs are taken at T too")
    seed: int = flag(0, "seed of the problem draws and the sampling")


def check_task(cfg):
    """Reject bad task values before the slow start-up; a --reward_file is loaded first (it adds reward names)."""
    if cfg.prompt_format not in ("chat", "raw"):
        raise SystemExit(f"unknown --prompt_format {cfg.prompt_format!r}: use one of chat, raw")
    if cfg.num_generations < 2:
        raise SystemExit(f"--num_generations must be at least 2 (GRPO compares completions within a group), "
                         f"got {cfg.num_generations}")
    if cfg.temperature <= 0:
        raise SystemExit("--temperature must be > 0: greedy completions of a prompt are all the same")
    if cfg.reward_file:
        load_reward_file(cfg.reward_file)
    try:
        parse_reward_spec(cfg.reward_funcs, cfg.reward_weights)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def load_data(cfg):
    """The problems cfg names: [{"question", "answer"}, ...]."""
    return load_problems(cfg.dataset, split=cfg.split, config=cfg.dataset_config or None,
                         question_field=cfg.question_field, answer_field=cfg.answer_field)
