"""The run's log: one JSON line per step in runs/NAME/metrics.jsonl, and its curves in curves.png."""
import json
import os

from tqdm import tqdm


def log_step(metrics_path, record):
    if record.get("skipped_updates"):
        tqdm.write(f"warning: step {record['step']}: non-finite loss or gradient, update skipped")
    with open(metrics_path, "a") as f:
        f.write(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in record.items()}) + "\n")


def finish_run(run_dir, last_step, rank):
    """End of training: rank 0 plots the curves; every rank says where the results are."""
    metrics_path, curves = os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "curves.png")
    if rank == 0:
        plot_curves(metrics_path, curves)
    print(f"done: {run_dir}/step_{last_step} ({metrics_path}, {curves})")


def plot_curves(metrics_path, out_png):
    """The run's curves, one panel per diagnostic, from metrics.jsonl."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f]
    keys = ["reward_mean", "accuracy", "format_rate", "kl", "completion_len", "zero_var_frac"]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    steps, w = [r["step"] for r in rows], max(1, min(20, len(rows) // 10))
    for ax, key in zip(axes.flat, keys):
        values = [r[key] for r in rows]
        windows = [values[max(0, i - w + 1):i + 1] for i in range(len(values))]
        ax.plot(steps, values, alpha=0.3, color="tab:blue")  # one step is only 64 samples: noisy
        ax.plot(steps, [sum(v) / len(v) for v in windows], color="tab:blue")
        ax.set_title(f"{key} (line: mean of last {w} steps)" if key == keys[0] else key)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
