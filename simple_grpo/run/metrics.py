"""The run's log: one JSON line per step in runs/NAME/metrics.jsonl, and the curves drawn from it
(report.py writes them to curves.png and report.html). --report_to also sends each step to TensorBoard or W&B.

metrics.jsonl holds step records ({"step": 3, "reward_mean": ...}) and the run doctor's warnings
({"step": 3, "warning": "kl", "message": ...}, doctor.py); readers tell them apart by "warning"."""
import io
import json
import math
import os

import torch.distributed as dist
from tqdm import tqdm

from simple_grpo.run.disk_guard import append_lines

# what curves.png shows, 2 rows of 4; report.html shows more (report.CURVE_KEYS)
CURVES = ["reward_mean", "accuracy", "format_rate", "kl", "completion_len", "zero_var_frac", "entropy",
          "truncated_frac"]
TRACKERS = {"tensorboard": ("tensorboard", "pip install tensorboard"), "wandb": ("wandb", "pip install wandb")}


class Tracker:
    """--report_to: none, tensorboard (runs/NAME/tensorboard/) or wandb (project simple_grpo, the run's name)."""

    @staticmethod
    def check(report_to):
        """Fail before the slow start-up when the tracker's package is missing, saying what to install."""
        if report_to == "none":
            return
        if report_to not in TRACKERS:
            raise SystemExit(f"unknown --report_to {report_to!r}: use none, tensorboard or wandb")
        package, install = TRACKERS[report_to]
        import importlib.util
        if importlib.util.find_spec(package) is None:
            raise SystemExit(f"--report_to {report_to} needs the {package} package: {install} (or --report_to none)")

    def __init__(self, cfg, run_dir):
        self.check(cfg.report_to)
        self.kind, self.writer = cfg.report_to, None
        if self.kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        elif self.kind == "wandb":
            import dataclasses
            import wandb
            self.writer = wandb.init(project="simple_grpo", name=cfg.run_name, config=dataclasses.asdict(cfg))

    def log(self, record):
        numbers = {k: v for k, v in record.items() if k != "step" and is_number(v)}
        if self.kind == "tensorboard":
            for key, value in numbers.items():
                self.writer.add_scalar(key, value, record["step"])
        elif self.kind == "wandb":
            self.writer.log(numbers, step=record["step"])

    def close(self):
        if self.kind == "tensorboard":
            self.writer.close()
        elif self.kind == "wandb":
            self.writer.finish()


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def add_part_stats(stats, part, share):
    """Fold one micro-batch's diagnostics into the step's: *_min and *_max keep the extremes, the rest
    are token means, weighted by the part's share of the step's tokens."""
    for key, value in part.items():
        if key.endswith("_max"):
            stats[key] = max(stats.get(key, value), value)
        elif key.endswith("_min"):
            stats[key] = min(stats.get(key, value), value)
        else:
            stats[key] = stats.get(key, 0.0) + value * share


# the figures of the largest sampler gap (doctor.sampler_gap_details): they come from the rank that holds it
AT_LARGEST_GAP = ("sampler_gap_token", "sampler_gap_pos", "sampler_gap_sampler_logp", "sampler_gap_trainer_logp")


def stats_over_ranks(stats):
    """The whole batch's diagnostics from every rank's: *_max and *_min keep the extremes, the largest
    sampler gap's figures come from the rank that holds it, and the rest add up (each rank's are its share
    of the batch's token means, or its counts). One rank: stats as they are."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return stats
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, stats)  # a few numbers a rank, between this run's own processes
    merged = {}
    for key in stats:
        values = [s[key] for s in every]
        if key.endswith("_max"):
            merged[key] = max(values)
        elif key.endswith("_min"):
            merged[key] = min(values)
        elif key in AT_LARGEST_GAP:
            merged[key] = max(every, key=lambda s: s["sampler_gap_max"])[key]
        else:
            merged[key] = sum(values)
    return merged


def significant(value, digits=6):
    """value to `digits` significant digits: an lr of 1e-6 and a KL of 3e-7 keep theirs
    (rounding to decimal places would log both as 0.0)."""
    return float(f"{value:.{digits}g}")


def log_step(metrics_path, record, tracker=None):
    if record.get("skipped_updates"):
        tqdm.write(f"warning: step {record['step']}: non-finite loss or gradient, update skipped")
    append_lines(metrics_path, [json.dumps({k: significant(v) if isinstance(v, float) else v
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


def running_mean(values, window):
    """At each point, the mean of the last `window` values (of fewer at the start)."""
    means = []
    for i in range(len(values)):
        recent = values[max(0, i - window + 1):i + 1]
        means.append(sum(recent) / len(recent))
    return means


def curves_png(rows, keys, columns=4):
    """One panel per key the rows hold (step records), raw values faint and a running mean bold (a tenth
    of the steps, 1 to 20: one step is only 64 samples, noisy), as PNG bytes; None when none is logged."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = [k for k in keys if any(is_number(r.get(k)) for r in rows)]
    if not keys:
        return None
    n_rows = math.ceil(len(keys) / columns)
    fig, axes = plt.subplots(n_rows, columns, figsize=(3.2 * columns, 2.4 * n_rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        points = [(r["step"], r[key]) for r in rows if is_number(r.get(key))]
        steps, values = [s for s, _ in points], [v for _, v in points]
        window = max(1, min(20, len(values) // 10))
        ax.plot(steps, values, alpha=0.3, color="tab:blue")
        ax.plot(steps, running_mean(values, window), color="tab:blue", linewidth=2)
        ax.set_title(f"{key} (line: mean of {window})" if key == keys[0] else key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    plt.close(fig)
    return buffer.getvalue()
