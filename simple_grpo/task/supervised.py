"""Supervised targets and batches on the answer format: what the tiny model was built with
(tools/build_tiny_model.py) and a real model's warm start is taught with (tools/warm_start.py).

A target is written from a problem's GSM8K solution, `<think>12+7=19\\n19-5=14</think><answer>14</answer>`,
or, for a share of them, in one of three styles out of format (the answer outside the tags, no
reasoning), so that sampling is in format only part of the time and GRPO has format left to learn.
"""
import re

import torch

from simple_grpo.task.rewards import true_answer


def solution_steps(gsm8k_answer):
    """'She buys 7 more: 12+7=<<12+7=19>>19\\n...\\n#### 19' -> '12+7=19\\n...'"""
    lines = gsm8k_answer.split("\n")[:-1]
    return "\n".join(re.sub(r"<<.*?>>", "", line.split(": ", 1)[1]) for line in lines)


def sft_target(problem, rng, in_format_share):
    """One supervised completion: in format with probability in_format_share, else one of
    three out-of-format styles (so format is learnable by RL, and greedy stays in format)."""
    steps, answer = solution_steps(problem["answer"]), true_answer(problem["answer"])
    u = rng.random()
    if u < in_format_share:
        return f"<think>{steps}</think><answer>{answer}</answer>"
    u = (u - in_format_share) / (1 - in_format_share)
    if u < 0.45:
        return f"<think>{steps}</think>The answer is {answer}."  # answer outside the tags
    if u < 0.75:
        return f"<answer>{answer}</answer>"  # no reasoning (usually wrong for a small model)
    return f"The answer is {answer}."


def make_batch(tokenizer, prompts, targets, end_token):
    """input_ids and labels (-100 on prompt and padding) for next-token training, (B, T); each
    target ends with end_token (the chat template's turn end), which the model learns to write."""
    rows = [tokenizer(p, add_special_tokens=False)["input_ids"] +
            tokenizer(t + end_token, add_special_tokens=False)["input_ids"]
            for p, t in zip(prompts, targets)]
    n_prompt = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), tokenizer.pad_token_id)
    labels = torch.full((len(rows), T), -100)
    for i, (row, n) in enumerate(zip(rows, n_prompt)):
        ids[i, :len(row)] = torch.tensor(row)
        labels[i, n:len(row)] = torch.tensor(row[n:])
    return ids, labels
