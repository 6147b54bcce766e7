"""The trainer's side: flags (config.py), the GRPO update (update.py), DeepSpeed (deepspeed_*.py), memory_plan.py."""
