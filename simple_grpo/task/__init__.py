"""What a run learns from: problems and prompts (problems.py), rewards (rewards.py), the task flags (config.py)."""
