"""tools/reading_path.py: what a careful reader reads to understand one default step of grpo_train.py, as data.

    python tools/reading_path.py            # the table docs/guide.md holds, with its files and lines counted

One default step: the tiny model, beta 0.04, the reference server, no LoRA. PATH below names, in reading
order, each file and the functions of it the step runs (None: the whole file); a function's own calls to
functions of the same file are followed and counted too, so a helper cannot hide, except those NOT_RUN names
with the option that runs them (a reader of the default step skips that branch; "Class.method": that method
of a class). BY_DOCSTRING names the plumbing on the path (HTTP, retries, waiting, refusing bad input) whose
result its docstring states in full: its signature and docstring are counted, its body and its calls are
not, and the table names each such function with why. Lines are counted from the code (ast: first decorator
to last line, docstring and comments included), so a figure cannot go stale: tests/test_reading_path.py
checks that docs/guide.md's table is this script's output.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (file, the functions the step runs or None for the whole file, what the reader learns there)
PATH = [
    ("grpo_train.py", None, "the whole step, its stages marked `# GRPO 1.` to `4.` in `main`"),
    ("simple_grpo/trainer/config.py", ["check_options", "default_lr"],
     "the defaults the step depends on: lr, epsilon_high, scale_rewards, ref_url"),
    ("grpo_math.py", ["grpo_objective", "completion_mask", "is_truncated", "group_advantages", "groups_with_signal",
                      "completion_logps", "grpo_loss"],
     "the loss in a dozen lines, then each term as the step calls it"),
    ("simple_grpo/task/problems.py", ["make_prompt", "stop_token_ids"], "the prompt and the stop tokens"),
    ("simple_grpo/generation/hf_sampler.py", ["generate"], "stage 1: sampling from softmax(logits / T)"),
    ("simple_grpo/rollouts.py", ["score_groups", "correct_rows", "rollout_stats"], "stage 2: rewards per group"),
    ("simple_grpo/task/rewards.py", ["parse_reward_spec", "score", "correctness_reward", "format_reward",
                                     "extract_answer", "pick_accuracy_reward"], "the reward weights; how a completion is scored"),
    ("simple_grpo/protocol.py", ["uses_ref_server", "reference_logps_from_server"],
     "stage 3, the trainer's side: the upload and the answer"),
    ("ref_server.py", ["ref_worker"], "stage 3, the server's side: the order groups are served in"),
    ("simple_grpo/logprobs.py", ["reference_group_logps"],
     "what the server computes: completion_logps's numbers, by a shared prompt, in the server's dtype"),
    ("simple_grpo/trainer/update.py", ["loss_options", "optimizer_step", "step_stats"], "stage 4: the optimizer step"),
    ("simple_grpo/trainer/deepspeed_config.py", ["flag_config"], "what engine.step() does: AdamW, the clip"),
]
# functions the step's functions call only under an option the default step does not take: {file: {name: why}}
NOT_RUN = {"simple_grpo/trainer/config.py": {"check_lora": "--use_peft"},
           "grpo_math.py": {"capped_is_weight": "vLLM's log-probs, in grpo_vllm_one.py"},
           "simple_grpo/logprobs.py": {"token_entropy": "entropy=True, which the server does not ask",
                                       "ChunkedLogProbs.backward": "a gradient; the server runs under inference_mode"}}
# plumbing read by its docstring alone: {file: {name: what its body does that changes no number of the step}}
BY_DOCSTRING = {"simple_grpo/trainer/config.py": {"check_values": "refuses bad values, sets nothing"},
                "simple_grpo/task/rewards.py": {"parse_reward_spec": "its body splits the two flags and refuses bad names or weights"},
                "simple_grpo/protocol.py": {"post_groups": "HTTP, retried while the server is busy",
                                            "take_group": "polls the server, says what it waits for"}}


def definitions(tree):
    """Top-level functions and classes of a module: {name: node}."""
    return {node.name: node for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def span(node, skip=()):
    """The lines a definition takes: its first decorator to its last line, less the methods in skip."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    skipped = sum(span(method) for method in getattr(node, "body", []) if f"{node.name}.{getattr(method, 'name', '')}" in skip)
    return node.end_lineno - first + 1 - skipped


def docstring_span(node):
    """The lines from a function's first decorator to the end of its docstring."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    if not (node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)):
        raise SystemExit(f"reading_path: {node.name} is read by its docstring (BY_DOCSTRING) but has none")
    return node.body[0].end_lineno - first + 1


def followed(names, defs, path, skip=(), by_docstring=()):
    """names and every function of the same module they call by name, transitively, in first-seen order;
    those in skip are not followed, nor are the calls of those in by_docstring (read by their docstring)."""
    def exists(name):
        cls, _, method = name.partition(".")
        return cls in defs and (not method or any(getattr(m, "name", None) == method for m in defs[cls].body))
    missing = [name for name in [*names, *skip, *by_docstring] if not exists(name)]
    if missing:
        raise SystemExit(f"reading_path: {path} has no {', '.join(missing)}: update PATH in tools/reading_path.py")
    seen, todo = [], list(names)
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.append(name)
        if name in by_docstring:
            continue
        for node in ast.walk(defs[name]):
            if isinstance(node, ast.Name) and node.id in defs and node.id not in [*seen, *skip, name]:
                todo.append(node.id)
    return seen


def reading_path():
    """[(file, [(function, lines)] or None, file's lines, lines read, why)] for PATH."""
    rows = []
    for path, names, why in PATH:
        source = open(os.path.join(ROOT, path)).read()
        total = len(source.splitlines())
        if names is None:
            rows.append((path, None, total, total, why))
            continue
        defs = definitions(ast.parse(source))
        skip, by_docstring = NOT_RUN.get(path, {}), BY_DOCSTRING.get(path, {})
        functions = [(name, docstring_span(defs[name]) if name in by_docstring else span(defs[name], skip))
                     for name in followed(names, defs, path, skip, by_docstring)]
        rows.append((path, functions, total, sum(n for _, n in functions), why))
    return rows


def table():
    """The guide's table: a line per file, then the totals."""
    rows = reading_path()
    lines = ["| # | file | what is read (lines) | lines read / file | why |", "|---|---|---|---|---|"]
    for i, (path, functions, total, read, why) in enumerate(rows, 1):
        by_docstring = BY_DOCSTRING.get(path, {})
        what = "all" if functions is None else ", ".join(
            f"`{name}` ({n}: its docstring; {by_docstring[name]})" if name in by_docstring else f"`{name}` ({n})"
            for name, n in functions)
        what += "".join(f"; not `{name}` (only with {why})" for name, why in NOT_RUN.get(path, {}).items())
        lines.append(f"| {i} | `{path}` | {what} | {read} / {total} | {why} |")
    files, read = len(rows), sum(row[3] for row in rows)
    lines.append(f"\n{files} files, {read} lines (counted by `python tools/reading_path.py`).")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
