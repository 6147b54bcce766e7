"""A run's outputs and guards: run directory and checkpoints (checkpoints.py), metrics.jsonl (metrics.py),
completions.jsonl (completions_log.py), report.html (report.py), the run doctor (doctor.py), the pre-flight
probe (probe.py; preflight.py runs it in a process of its own before training), the full-disk guard
(disk_guard.py)."""
