"""The task: its flags (DataConfig, TaskConfig), the problems ({"question": str, "answer": "...#### N"}, from a
file or a hub dataset) and the prompts."""
import csv
import json
import os
from dataclasses import dataclass

from simple_grpo.flags import flag
from simple_grpo.task.rewards import load_reward_file, parse_reward_spec, true_answer

# The system prompt of the R1-Zero-style GSM8K recipe (as in lsdefine/simple_GRPO).
SYSTEM_PROMPT = ("A conversation between User and Assistant. The user asks a question, and the "
                 "Assistant solves it. The Assistant first thinks about the reasoning process in "
                 "the mind and then provides the user with the answer. The reasoning process and "
                 "answer are enclosed within <think> </think> and <answer> </answer> tags, "
                 "respectively, i.e., <think> reasoning process here </think><answer> answer "
                 "here </answer>.")
FILE_TYPES = (".jsonl", ".json", ".parquet", ".csv")
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


def _read_file(path):
    """(where, row) pairs of a local file: JSONL line numbers, else row numbers."""
    ext = os.path.splitext(path)[1]
    if ext == ".csv":
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: spreadsheets start with a BOM
            return [(f"row {i}", row) for i, row in enumerate(csv.DictReader(f), 1)]
    if ext == ".parquet":
        import pyarrow.parquet as pq
        try:
            rows = pq.read_table(path).to_pylist()
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
        return [(f"row {i}", row) for i, row in enumerate(rows, 1)]
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if ext == ".json" and text.lstrip().startswith("["):  # a JSON list; other .json files are JSON lines
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
        return [(f"row {i}", row) for i, row in enumerate(rows, 1)]
    rows = []
    for lineno, line in enumerate(text.split("\n"), 1):  # not splitlines(): JSON strings may hold U+2028
        if line.strip():
            try:
                rows.append((f"line {lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {lineno}: not valid JSON ({e.msg})") from None
    return rows


def _read_hub(name, config, split):
    """(where, row) pairs of a hub dataset split; fails in seconds when the hub is unreachable."""
    import datasets
    import requests
    from huggingface_hub import constants
    config_part = f"config {config!r}, " if config else ""
    what = f"dataset {name!r} ({config_part}split {split!r}) from the Hugging Face hub"
    if not datasets.config.HF_HUB_OFFLINE:  # the hub client retries for ~25 s before it gives up
        try:
            requests.head(constants.ENDPOINT, timeout=5)
        except requests.RequestException as e:
            raise ConnectionError(f"could not load {what}: {constants.ENDPOINT} did not answer "
                                  f"({type(e).__name__}). For a local file give its path "
                                  f"({', '.join(FILE_TYPES)}); for a copy in the hub cache set "
                                  "HF_HUB_OFFLINE=1") from None
    try:
        rows = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # not found, gated, unknown config or split, offline and not cached
        raise OSError(f"could not load {what}: {e}") from e
    return [(f"row {i}", dict(row)) for i, row in enumerate(rows, 1)]


def load_problems(dataset, *, split="train", config=None, question_field="question", answer_field="answer"):
    """Problems from a local file or a hub dataset, with the canonical keys; a bad row raises, naming it."""
    dataset = os.fspath(dataset)
    if dataset.endswith(FILE_TYPES) or os.path.exists(dataset):
        if not os.path.isfile(dataset):
            raise FileNotFoundError(f"data file {dataset} not found")
        if not dataset.endswith(FILE_TYPES):
            raise ValueError(f"{dataset}: unknown file type; use one of {', '.join(FILE_TYPES)}")
        rows, source = _read_file(dataset), dataset
    else:
        rows, source = _read_hub(dataset, config, split), f"{dataset} [{split}]"
    if not rows:
        raise ValueError(f"{source}: no problems in it")
    problems = []
    for where, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{source}, {where}: expected an object with fields, got {type(row).__name__}")
        for field in (question_field, answer_field):
            if field not in row:
                raise ValueError(f"{source}, {where}: no field {field!r}; fields present: "
                                 f"{sorted(map(str, row))} (choose them with question_field / answer_field)")
            if not isinstance(row[field], str) or not row[field].strip():
                raise ValueError(f"{source}, {where}: field {field!r} must be non-empty text, got {row[field]!r}")
        try:
            true_answer(row[answer_field])  # the correctness reward needs GSM8K's '#### N' line
        except ValueError as e:
            raise ValueError(f"{source}, {where}: {e}") from None
        rest = {k: v for k, v in row.items() if k not in (question_field, answer_field)}
        problems.append({**rest, "question": row[question_field], "answer": row[answer_field]})
    return problems


def load_jsonl(path):
    """Problems from a GSM8K-format JSONL file; a bad row raises an error naming the file and line."""
    return load_problems(path)


def make_prompt(tokenizer, question, prompt_format="chat", system_prompt=SYSTEM_PROMPT):
    """The text the model continues: the chat template with the assistant's turn opened, or raw text."""
    if prompt_format == "chat":
        messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if prompt_format == "raw":
        return f"{system_prompt}\nUser: {question}\nAssistant:"
    raise ValueError(f"unknown prompt_format {prompt_format!r}; use 'chat' or 'raw'")


def chat_turn_end_id(tokenizer):
    """The special token the chat template writes after an assistant turn (<|im_end|>, <|eot_id|>), else None."""
    if not tokenizer.chat_template:
        return None
    marker = "\u2063answer\u2063"  # text no template writes itself
    turn = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}],
                                         tokenize=False)
    after = tokenizer(turn.split(marker, 1)[1], add_special_tokens=False)["input_ids"]
    return after[0] if after and after[0] in tokenizer.all_special_ids else None


def stop_token_ids(tokenizer, prompt_format="chat", model=None):
    """The ids that end a completion: the tokenizer's EOS, the chat template's turn end, the generation config's."""
    from transformers import AutoConfig, GenerationConfig
    model = model or tokenizer.name_or_path
    try:
        generation = GenerationConfig.from_pretrained(model)
    except OSError:  # no generation_config.json: vLLM builds one from config.json
        try:
            generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model))
        except OSError:  # no config.json either
            generation = GenerationConfig()
    eos = generation.eos_token_id
    turn_end = chat_turn_end_id(tokenizer) if prompt_format == "chat" else None
    candidates = [tokenizer.eos_token_id, turn_end, *([eos] if isinstance(eos, int) else eos or [])]
    ids = list(dict.fromkeys(i for i in candidates if i is not None))  # in order, once each
    if not ids:
        raise ValueError("the tokenizer has no EOS token, its chat template no turn-end token and the model's "
                         "generation config no eos_token_id: completions would never end")
    return ids
