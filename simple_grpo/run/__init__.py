"""A run's outputs and guards: checkpoints, logs, the run doctor, the pre-flight probe, report.html, the disk guard."""
