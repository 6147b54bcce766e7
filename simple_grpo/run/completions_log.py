"""runs/NAME/completions.jsonl: every --log_completions_every N steps, a few trained completions (tools/view_run.py
shows them; model output, untrusted text). One JSON object per line: step, prompt, completion, reward, rewards (by
function), advantage, tokens (each decoded alone, the stop token included) and, per token or null, logps (the
trainer's), sampler_logps (vLLM's) and ratio (exp(logps - sampler_logps))."""
import json
import math
import os

import torch

from simple_grpo.run.disk_guard import append_lines
from grpo_math import completion_mask
from simple_grpo.generation.vllm_sampler import generated_lengths

REQUIRED_KEYS = ("prompt", "completion", "reward")
PER_TOKEN_KEYS = ("logps", "sampler_logps", "ratio")


def _number(value):
    """JSON-safe and short: floats to 5 decimals; NaN and infinities (not JSON) become null."""
    value = float(value)
    return round(value, 5) if math.isfinite(value) else None


def _per_token(values, n_tokens, key, index):
    if values is None:
        return None
    values = [_number(v) for v in values]
    if len(values) != n_tokens:
        raise ValueError(f"completion row {index}: {key!r} has {len(values)} values for {n_tokens} tokens; "
                         "give one per token of the completion (its stop token included)")
    return values


def log_completions(path, step, rows):
    """Append `rows` (dicts with the keys in this module's docstring; prompt, completion and reward
    are required, the rest may be missing or None) to the JSON-lines file `path`, tagged with `step`."""
    lines = []
    for i, row in enumerate(rows):
        missing = [k for k in REQUIRED_KEYS if k not in row]
        if missing:
            raise ValueError(f"completion row {i} has no {missing}: every row needs {list(REQUIRED_KEYS)}")
        tokens = [str(t) for t in row.get("tokens") or []]
        record = {"step": int(step), "prompt": str(row["prompt"]), "completion": str(row["completion"]),
                  "reward": _number(row["reward"]),
                  "rewards": {str(k): _number(v) for k, v in (row.get("rewards") or {}).items()},
                  "advantage": None if row.get("advantage") is None else _number(row["advantage"]),
                  "tokens": tokens}
        for key in PER_TOKEN_KEYS:
            record[key] = _per_token(row.get(key), len(tokens), key, i)
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    append_lines(path, lines)


def read_completions(path):
    """The rows of a completions.jsonl file; a bad line raises an error naming the file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError(f"{path}, line {lineno}: expected an object with a 'step', "
                                 "as simple_grpo/run/completions_log.py writes")
            rows.append(row)
    return rows


def pick_groups(rewards, G, groups=1):
    """Indices of the completions of the first `groups` groups whose rewards differ (the ones GRPO
    learns from), topped up with the first all-alike groups when too few differ. rewards (Q*G,)."""
    by_group = [rewards[q * G:(q + 1) * G] for q in range(len(rewards) // G)]
    varied = [q for q, r in enumerate(by_group) if max(r) != min(r)]
    alike = [q for q, r in enumerate(by_group) if max(r) == min(r)]
    return [q * G + g for q in (varied + alike)[:groups] for g in range(G)]


def completion_rows(tokenizer, prompts, completion_ids, mask, scores, advantages, G, *, logps=None,
                    sampler_logps=None, ratio=None, groups=1):
    """Rows for log_completions from a step's tensors: the G completions of `groups` groups (pick_groups).
    prompts [Q] texts; completion_ids, mask (Q*G, C); scores [Q*G] dicts from task/rewards.py's score;
    advantages (Q*G,); logps, sampler_logps, ratio (Q*G, C) or None."""
    rows = []
    for i in pick_groups([s["reward"] for s in scores], G, groups):
        n = int(mask[i].sum())
        ids = completion_ids[i, :n].tolist()
        row = {"prompt": prompts[i // G],
               "completion": tokenizer.decode(ids, skip_special_tokens=True),
               "reward": scores[i]["reward"],
               "rewards": {k: v for k, v in scores[i].items() if k != "reward"},
               "advantage": float(advantages[i]),
               "tokens": [tokenizer.decode([t]) for t in ids]}
        for key, values in (("logps", logps), ("sampler_logps", sampler_logps), ("ratio", ratio)):
            row[key] = None if values is None else values[i, :n].tolist()
        rows.append(row)
    return rows


def log_batch_completions(run_dir, step, tokenizer, batch, scores, stop_ids, logps, groups=1):
    """A trainer's call: `groups` groups of the collated batch it just trained on (rollouts.py's collate)
    to run_dir/completions.jsonl, with the trainer's per-token log-probs `logps` (Q*G, C) and, where
    another engine sampled (batch["sampler_logps"], vLLM's), the sampler's and the ratio pi_trainer / pi_sampler.
    scores: each completion's reward breakdown, in the batch's order."""
    Q = batch["prompt_ids"].size(0)
    G = batch["completion_ids"].size(0) // Q
    prompts = [tokenizer.decode(ids[m.bool()], skip_special_tokens=False)
               for ids, m in zip(batch["prompt_ids"].cpu(), batch["prompt_mask"].cpu())]
    logps = logps.float().cpu()
    sampler = batch["sampler_logps"].float().cpu() if "sampler_logps" in batch else None
    rows = completion_rows(tokenizer, prompts, batch["completion_ids"].cpu(),
                           completion_mask(batch["completion_ids"].cpu(), stop_ids,
                                           lengths=None if sampler is None else generated_lengths(sampler)), scores,
                           batch["advantages"].cpu(), G, logps=logps, sampler_logps=sampler,
                           ratio=None if sampler is None else torch.exp(logps - sampler), groups=groups)
    log_completions(os.path.join(run_dir, "completions.jsonl"), step, rows)
