"""Problems and prompts. A problem is {"question": str, "answer": "...#### N"}, read by load_problems from a local
.jsonl, .json, .parquet or .csv file or a Hugging Face hub dataset ("openai/gsm8k", config "main"), other field
names mapped onto these two. A prompt is the question in the model's chat template, or plain text.
"""
import csv
import json
import os

from simple_grpo.task.rewards import true_answer

# The system prompt of the R1-Zero-style GSM8K recipe (as in lsdefine/simple_GRPO).
SYSTEM_PROMPT = ("A conversation between User and Assistant. The user asks a question, and the "
                 "Assistant solves it. The Assistant first thinks about the reasoning process in "
                 "the mind and then provides the user with the answer. The reasoning process and "
                 "answer are enclosed within <think> </think> and <answer> </answer> tags, "
                 "respectively, i.e., <think> reasoning process here </think><answer> answer "
                 "here </answer>.")
FILE_TYPES = (".jsonl", ".json", ".parquet", ".csv")


def _read_file(path):
    """(where, row) pairs of a local file, where as a user counts: JSONL lines (blank ones too), else data rows."""
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
    """Problems from a local file (by extension) or, when `dataset` is no existing path, a hub dataset (`split`
    and `config` are its), with the canonical keys; the first bad row raises, naming the file and row."""
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
    """The text the model continues. chat: the chat template with the assistant's turn opened; raw: plain text
    (base models without a template), ending at "Assistant:": the completion is to write "<think>" itself."""
    if prompt_format == "chat":
        messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if prompt_format == "raw":
        return f"{system_prompt}\nUser: {question}\nAssistant:"
    raise ValueError(f"unknown prompt_format {prompt_format!r}; use 'chat' or 'raw'")


def chat_turn_end_id(tokenizer):
    """The special token the chat template writes after an assistant turn (<|im_end|> for ChatML, <|eot_id|>
    for Llama 3), or None where the tokenizer has no template or the template ends a turn with ordinary text."""
    if not tokenizer.chat_template:
        return None
    marker = "\u2063answer\u2063"  # text no template writes itself
    turn = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}],
                                         tokenize=False)
    after = tokenizer(turn.split(marker, 1)[1], add_special_tokens=False)["input_ids"]
    return after[0] if after and after[0] in tokenizer.all_special_ids else None


def stop_token_ids(tokenizer, prompt_format="chat", model=None):
    """The ids that end a completion, for both samplers and every mask: the tokenizer's EOS, under a chat template
    its turn end (a base model's EOS, Qwen2.5's <|endoftext|>, is not), and the eos ids of the model's generation
    config (model: its directory; None: the tokenizer's), at which vLLM stops too."""
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
