"""Problems and prompts: reading GSM8K-format JSONL and turning questions into chat prompts.

A problem is {"question": str, "answer": "...#### N"}. The prompt is the model's chat
template applied to the system prompt below and the question, ready for generation.
"""
import json

# The system prompt of the R1-Zero-style GSM8K recipe (as in lsdefine/simple_GRPO).
SYSTEM_PROMPT = ("A conversation between User and Assistant. The user asks a question, and the "
                 "Assistant solves it. The Assistant first thinks about the reasoning process in "
                 "the mind and then provides the user with the answer. The reasoning process and "
                 "answer are enclosed within <think> </think> and <answer> </answer> tags, "
                 "respectively, i.e., <think> reasoning process here </think><answer> answer "
                 "here </answer>.")


def load_jsonl(path):
    """Problems from a JSONL file; a bad row raises an error naming the file and line."""
    problems = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            missing = [k for k in ("question", "answer") if not isinstance(row.get(k), str)]
            if missing:
                raise ValueError(f"{path}:{lineno}: missing text field(s) {missing}")
            problems.append(row)
    if not problems:
        raise ValueError(f"{path}: no problems in file")
    return problems


def chat_prompt(tokenizer, question):
    """The text the model continues: system prompt + question + the assistant's turn opener."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
