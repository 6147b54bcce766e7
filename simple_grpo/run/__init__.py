"""A run's outputs and guards: its directory and checkpoints, metrics.jsonl and curves.png, completions.jsonl, the
run doctor, the pre-flight probe, report.html (tools/view_run.py) and the full-disk guard."""
