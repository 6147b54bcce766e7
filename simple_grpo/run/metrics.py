"""runs/NAME/metrics.jsonl: one JSON line per step, and the run doctor's warnings (lines with a "warning" key);
curves.png drawn from it at the end. --report_to also sends each step to TensorBoard or W&B."""
import dataclasses
import importlib.util
import io
import json
import math
import os

import torch.distributed as dist
from tqdm import tqdm

from simple_grpo.run.disk_guard import append_lines

# curves.png's panels, 2 rows of 4 (tools/view_run.py's page shows more)
CURVES = ["reward_mean", "accuracy", "format_rate", "kl", "completion_len", "zero_var_frac", "entropy",
          "truncated_frac"]
TRACKERS = ("tensorboard", "wandb")  # --report_to's choices but none; each is its pip package's name too


class Tracker:
    """--report_to tensorboard (runs/NAME/tensorboard/) or wandb (project simple_grpo, the run's name)."""

    @staticmethod
    def check(report_to):
        """Fail before the slow start-up when --report_to is unknown or its package is missing."""
        if report_to != "none" and report_to not in TRACKERS:
            raise SystemExit(f"unknown --report_to {report_to!r}: use none, tensorboard or wandb")
        if report_to != "none" and importlib.util.find_spec(report_to) is None:
            raise SystemExit(f"--report_to {report_to} needs the {report_to} package: pip install {report_to} "
                             "(or --report_to none)")

    def __init__(self, cfg, run_dir):
        self.kind = cfg.report_to
        if self.kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        elif self.kind == "wandb":
            import wandb
            self.writer = wandb.init(project="simple_grpo", name=cfg.run_name, config=dataclasses.asdict(cfg))
        else:
            raise ValueError(f"no tracker for --report_to {self.kind!r}")

    def log(self, record):
        numbers = {k: v for k, v in record.items() if k != "step" and is_number(v)}
        if self.kind == "tensorboard":
            for key, value in numbers.items():
                self.writer.add_scalar(key, value, record["step"])
        else:
            self.writer.log(numbers, step=record["step"])

    def close(self):
        if self.kind == "tensorboard":
            self.writer.close()
        else:
            self.writer.finish()


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# the largest sampler gap's figures (doctor.sampler_gap_details): taken from the part that holds it
AT_LARGEST_GAP = ("sampler_gap_token", "sampler_gap_pos", "sampler_gap_sampler_logp", "sampler_gap_trainer_logp")


def add_part_stats(stats, part, share=1):
    """Fold one part's diagnostics (a micro-batch's, or a rank's) into `stats`: *_max and *_min keep the extremes,
    AT_LARGEST_GAP comes from the part with the largest gap, the rest add up, weighted by `share`."""
    larger_gap = part.get("sampler_gap_max", -math.inf) > stats.get("sampler_gap_max", -math.inf)  # none: no token
    for key, value in part.items():
        if key.endswith("_max"):
            stats[key] = max(stats.get(key, value), value)
        elif key.endswith("_min"):
            stats[key] = min(stats.get(key, value), value)
        elif key in AT_LARGEST_GAP:
            stats[key] = value if larger_gap else stats[key]
        else:
            stats[key] = stats.get(key, 0) + value * share


def stats_over_ranks(stats):
    """The whole batch's diagnostics: every rank's (its shares of the token means, its counts) by add_part_stats."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return stats
    every, merged = [None] * dist.get_world_size(), {}
    dist.all_gather_object(every, stats)
    for part in every:
        add_part_stats(merged, part)
    return merged


def log_step(metrics_path, record, tracker=None):
    if record.get("skipped_updates"):
        tqdm.write(f"warning: step {record['step']}: non-finite loss or gradient, update skipped")
    # floats to 6 significant digits: an lr of 1e-6 is not logged as 0.0
    append_lines(metrics_path, [json.dumps({k: float(f"{v:.6g}") if isinstance(v, float) else v
                                            for k, v in record.items()}) + "\n"])
    if tracker is not None:
        tracker.log(record)


def read_metrics(metrics_path):
    """The step records of metrics.jsonl, and the run doctor's warnings, as two lists."""
    steps, warnings = [], []
    with open(metrics_path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{metrics_path}, line {lineno}: not valid JSON ({e.msg})") from None
                (warnings if "warning" in row else steps).append(row)
    return steps, warnings


def curves_png(rows, keys, columns=4):
    """One panel per key the step records hold, raw values faint and a running mean (over a tenth of the steps,
    1 to 20) bold, as PNG bytes; None when none of the keys is logged."""
    from matplotlib.figure import Figure  # not pyplot: no GUI backend, no global figure to close
    keys = [k for k in keys if any(is_number(r.get(k)) for r in rows)]
    if not keys:
        return None
    n_rows = math.ceil(len(keys) / columns)
    fig = Figure(figsize=(3.2 * columns, 2.4 * n_rows), layout="tight")
    axes = fig.subplots(n_rows, columns, squeeze=False)
    for ax, key in zip(axes.flat, keys):
        points = [(r["step"], r[key]) for r in rows if is_number(r.get(key))]
        steps, values = [s for s, _ in points], [v for _, v in points]
        window = max(1, min(20, len(values) // 10))
        ax.plot(steps, values, alpha=0.3, color="tab:blue")
        means = [sum(values[max(0, i - window + 1):i + 1]) / min(i + 1, window) for i in range(len(values))]
        ax.plot(steps, means, color="tab:blue", linewidth=2)
        ax.set_title(f"{key} (line: mean of {window})" if key == keys[0] else key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    return buffer.getvalue()


def finish_run(run_dir, last_step, rank, tracker=None):
    """End of training: rank 0 closes the tracker and draws curves.png; every rank says where the results are."""
    metrics_path, curves = os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "curves.png")
    if rank == 0:
        if tracker is not None:
            tracker.close()
        png = curves_png(read_metrics(metrics_path)[0], CURVES)
        if png is not None:
            with open(curves, "wb") as f:
                f.write(png)
    print(f"done: {run_dir}/step_{last_step} ({metrics_path}, {curves}); the run's page with its completions: "
          f"python tools/view_run.py {run_dir}")
