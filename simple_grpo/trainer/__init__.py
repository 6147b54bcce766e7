"""The trainer's side: flags (config.py), the GRPO update (update.py), DeepSpeed (deepspeed_engine.py), memory_plan.py."""
