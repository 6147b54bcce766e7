"""A run's report as one static HTML page: the run doctor's warnings, the curves, and the logged
completions token by token. Written by tools/view_run.py (make demo runs it at the end of its run).

Reads runs/NAME/metrics.jsonl (step records and the doctor's warnings, metrics.py), and, when present,
runs/NAME/config.json (the run's flags) and runs/NAME/completions.jsonl (its format: completions_log.py;
written by a trainer's --log_completions_every N, and by tools/probe.py --log_completions). The page
needs no server and no network:
CSS is inline and the curves are an embedded PNG, so it opens from disk, or as a mail attachment.

Completions: each token is a span coloured by the completion's advantage (green: pushed up,
red: pushed down, deeper for larger |advantage|); hovering a token shows its log-prob, its
importance ratio and the trainer-vs-sampler log-prob gap where they were logged. A token whose
ratio lies outside the PPO clip range [1 - epsilon, 1 + epsilon_high] is outlined. Model text
is untrusted: everything from the run's files is HTML-escaped.
"""
import base64
import html
import json
import math
import os
import re
from dataclasses import dataclass

from simple_grpo.run.completions_log import read_completions
from simple_grpo.flags import flag
from simple_grpo.run.metrics import curves_png, is_number, read_metrics

# the curves, in this order, whichever of them the run logged
CURVE_KEYS = ["reward_mean", "accuracy", "format_rate", "kl", "completion_len", "zero_var_frac", "entropy",
              "truncated_frac", "clip_low_frac", "clip_high_frac", "grad_norm", "completion_len_max",
              "sampler_gap_mean", "is_weight_mean", "ratio_mean", "loss", "reward_std", "lr", "policy_lag",
              "tokens_per_s", "step_s"]
CURVE_COLUMNS = 5
SPECIAL_TOKEN = re.compile(r"<\|[^|<>]*\|>")  # <|im_start|>, <|eot_id|>: chat-template markers


@dataclass
class ViewConfig:
    run_dir: str = flag("", "the run's directory, runs/NAME (also the first positional argument)")
    out: str = flag("", "where to write the page (default: RUN_DIR/report.html)")
    completions_per_step: int = flag(4, "completions shown per logged step")
    steps_shown: int = flag(12, "logged steps shown at most: the first, the last and evenly spaced ones between")


# ---------------------------------------------------------------------------- reading the run
def short(value):
    """A number in 4 significant digits, without the minus of a rounded negative zero."""
    return f"{value:.4g}" if value != 0 else "0"


def plural(n, word):
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def read_config(run_dir):
    """The run's flags from config.json, or {} when it has none."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ---------------------------------------------------------------------------- curves
def first_last_table(rows):
    """Each curve's value at its first and last logged step, one column per curve."""
    columns = []
    for key in CURVE_KEYS:
        values = [r[key] for r in rows if is_number(r.get(key))]
        if values:
            columns.append((key, values[0], values[-1]))
    head = "".join(f"<th>{html.escape(key)}</th>" for key, _, _ in columns)
    first = "".join(f"<td>{short(v)}</td>" for _, v, _ in columns)
    last = "".join(f"<td>{short(v)}</td>" for _, _, v in columns)
    return (f"<table class='small'><tr><th></th>{head}</tr><tr><th>first step</th>{first}</tr>"
            f"<tr><th>last step</th>{last}</tr></table>")


# ---------------------------------------------------------------------------- completions
def advantage_colour(advantage):
    """Green for a positive advantage, red for a negative one, deeper as |advantage| grows (to 2)."""
    if advantage is None or not is_number(advantage) or advantage == 0:
        return "rgba(128,128,128,0.12)"
    alpha = 0.15 + 0.55 * min(abs(advantage) / 2, 1.0)
    return f"rgba(34,160,60,{alpha:.2f})" if advantage > 0 else f"rgba(220,40,40,{alpha:.2f})"


def token_title(i, row):
    """The hover text of token i: what was logged of its log-probs and ratio."""
    def at(key):
        values = row.get(key)
        return values[i] if isinstance(values, list) and i < len(values) and is_number(values[i]) else None
    logp, sampler_logp, ratio = at("logps"), at("sampler_logps"), at("ratio")
    parts = [f"token {i}"]
    if logp is not None:
        parts.append(f"logp {logp:.4f} (p {math.exp(logp):.3f})")
    if sampler_logp is not None:
        parts.append(f"sampler logp {sampler_logp:.4f}")
    if logp is not None and sampler_logp is not None:
        parts.append(f"trainer - sampler gap {logp - sampler_logp:+.4f}")
    if ratio is not None:
        parts.append(f"ratio {ratio:.4f}")
    return "\n".join(parts), ratio


def token_spans(row, clip_low, clip_high):
    """The completion's tokens as coloured spans; the completion text itself when no tokens were logged."""
    colour = advantage_colour(row.get("advantage"))
    tokens = row.get("tokens") or []
    if not tokens:
        return f"<span class='tok' style='background:{colour}'>{html.escape(str(row.get('completion', '')))}</span>"
    spans = []
    for i, token in enumerate(tokens):
        title, ratio = token_title(i, row)
        outside = ratio is not None and not clip_low <= ratio <= clip_high
        spans.append(f"<span class='tok{' outside' if outside else ''}' style='background:{colour}' "
                     f"title='{html.escape(title, quote=True)}'>{html.escape(str(token))}</span>")
    return "".join(spans)


def breakdown_table(row):
    """Reward, each reward function's value and the advantage of one completion."""
    rewards = row.get("rewards") or {}
    names = ["reward", *rewards, "advantage", "tokens"]
    values = [row.get("reward"), *rewards.values(), row.get("advantage"), len(row.get("tokens") or [])]
    head = "".join(f"<th>{html.escape(str(n))}</th>" for n in names)
    body = "".join(f"<td>{v:.3g}</td>" if is_number(v) else f"<td>{html.escape(str(v))}</td>" for v in values)
    return f"<table class='small'><tr>{head}</tr><tr>{body}</tr></table>"


def completion_html(row, clip_low, clip_high):
    prompt = str(row.get("prompt", ""))
    tail = " ".join(SPECIAL_TOKEN.sub(" ", prompt).split())[-100:]  # the question's end, without <|im_end|> and such
    return (f"<div class='completion'><details><summary>prompt ({len(prompt)} characters): &hellip;"
            f"{html.escape(tail)}</summary><pre>{html.escape(prompt)}</pre></details>"
            f"<div class='tokens'>{token_spans(row, clip_low, clip_high)}</div>{breakdown_table(row)}</div>")


def steps_to_show(steps, most):
    """At most `most` of the sorted steps: the first, the last and evenly spaced ones between."""
    if len(steps) <= most:
        return steps
    picks = {round(i * (len(steps) - 1) / (most - 1)) for i in range(most)} if most > 1 else {len(steps) - 1}
    return [steps[i] for i in sorted(picks)]


def completions_section(rows, cfg, run_config):
    """The logged completions, a few per step, with a legend."""
    epsilon = run_config.get("epsilon", 0.2)
    epsilon_high = run_config.get("epsilon_high") or epsilon
    clip_low, clip_high = 1 - epsilon, 1 + epsilon_high
    by_step = {}
    for row in rows:
        by_step.setdefault(row["step"], []).append(row)
    shown = steps_to_show(sorted(by_step), max(1, cfg.steps_shown))
    parts = [f"<p>{plural(len(rows), 'completion')} logged at {plural(len(by_step), 'step')}; shown: "
             f"{plural(len(shown), 'step')}, up to {cfg.completions_per_step} completions each. Colour: the completion's advantage "
             f"<span class='tok' style='background:{advantage_colour(1.5)}'>positive</span> "
             f"<span class='tok' style='background:{advantage_colour(-1.5)}'>negative</span> "
             f"<span class='tok' style='background:{advantage_colour(0)}'>zero</span>; "
             f"<span class='tok outside'>outlined</span>: ratio outside the clip range "
             f"[{clip_low:.2f}, {clip_high:.2f}]. Hover a token for its log-prob, ratio and "
             f"trainer-vs-sampler gap.</p>"]
    for step in shown:
        step_rows = by_step[step]
        parts.append(f"<h3>step {html.escape(str(step))} <span class='note'>({min(len(step_rows), cfg.completions_per_step)}"
                     f" of {len(step_rows)} logged)</span></h3>")
        parts.extend(completion_html(row, clip_low, clip_high) for row in step_rows[:cfg.completions_per_step])
    return "\n".join(parts)


# ---------------------------------------------------------------------------- the page
STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; max-width: 1300px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ddd; }
h3 { font-size: 15px; margin: 18px 0 6px; } .note { color: #777; font-weight: normal; }
table.small { border-collapse: collapse; font-size: 12px; margin: 6px 0; }
table.small td, table.small th { border: 1px solid #ddd; padding: 2px 8px; text-align: right; }
table.small th { background: #f4f4f4; }
img.curves { max-width: 100%; }
.completion { border: 1px solid #ddd; border-radius: 6px; padding: 8px 10px; margin: 8px 0; }
.completion summary { color: #555; font-size: 12px; cursor: pointer; }
.completion pre { white-space: pre-wrap; font-size: 12px; background: #f8f8f8; padding: 6px; }
.tokens { font-family: ui-monospace, monospace; font-size: 13px; white-space: pre-wrap; line-height: 1.9;
          margin: 6px 0; }
.tok { border-radius: 3px; padding: 1px 0; margin-right: 1px; }
.tok.outside { outline: 1.5px solid #222; }
"""


def build_report(cfg):
    """The page's HTML for the run in cfg.run_dir."""
    run_dir = cfg.run_dir.rstrip("/") or "."
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isdir(run_dir):
        raise SystemExit(f"run directory {run_dir} not found: give a run's directory, e.g. runs/demo")
    if not os.path.isfile(metrics_path):
        raise SystemExit(f"{metrics_path} not found: {run_dir} is not a run directory, or its run has not "
                         "logged a step yet")
    (metrics, warnings), run_config = read_metrics(metrics_path), read_config(run_dir)
    if not metrics:
        raise SystemExit(f"{metrics_path} holds no step yet: the run has not logged a step")
    name = os.path.basename(os.path.abspath(run_dir))
    steps = [r.get("step") for r in metrics]
    body = [f"<h1>Run {html.escape(name)}</h1>",
            f"<p>{plural(len(metrics), 'step')} logged (step {html.escape(str(steps[0]))} to {html.escape(str(steps[-1]))})"
            f", from {html.escape(os.path.abspath(run_dir))}.</p>"]
    if run_config:
        cells = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(json.dumps(v))}</td></tr>"
                        for k, v in run_config.items())
        body.append(f"<details><summary>the run's flags (config.json)</summary><table class='small'>{cells}"
                    "</table></details>")
    body.append("<h2>Curves</h2>")
    if warnings:
        items = "".join(f"<li><b>{html.escape(str(w['warning']))}</b> at step {html.escape(str(w.get('step')))}: "
                        f"{html.escape(str(w.get('message', '')))}</li>" for w in warnings)
        body.append(f"<h2>Run doctor</h2><ul class='warnings'>{items}</ul>")
    png = curves_png(metrics, CURVE_KEYS, CURVE_COLUMNS)
    if png is None:
        body.append("<p>metrics.jsonl holds none of the curves this page knows.</p>")
    else:
        body.append(f"<img class='curves' alt='curves' src='data:image/png;base64,{base64.b64encode(png).decode()}'>")
        body.append(first_last_table(metrics))
    body.append("<h2>Completions</h2>")
    completions_path = os.path.join(run_dir, "completions.jsonl")
    rows = read_completions(completions_path) if os.path.isfile(completions_path) else []
    if rows:
        body.append(completions_section(rows, cfg, run_config))
    else:
        body.append("<p>No completions were logged for this run: train with <code>--log_completions_every N</code> "
                    "to log a few completions every N steps (to completions.jsonl in the run's directory).</p>")
    return (f"<!doctype html>\n<html lang='en'><head><meta charset='utf-8'><title>run {html.escape(name)}</title>"
            f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_report(run_dir, out="", **options):
    """report.html for the run in run_dir (ViewConfig's options); returns its path."""
    cfg = ViewConfig(run_dir=run_dir, out=out, **options)
    page = build_report(cfg)
    out = cfg.out or os.path.join(cfg.run_dir, "report.html")
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    print(f"wrote {out} ({len(page) / 1e3:.0f} kB)")
    return out
