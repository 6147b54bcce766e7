"""A run's outputs and guards: run directory and checkpoints (checkpoints.py), metrics.jsonl (metrics.py),
completions.jsonl (completions_log.py), report.html (report.py), the run doctor (doctor.py), the pre-flight
probe (preflight.py), the full-disk guard (disk_guard.py), and starting the project's processes (launch.py)."""
