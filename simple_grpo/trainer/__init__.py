"""The trainer's side: its flags and checks (config.py), the GRPO update (update.py), the DeepSpeed engine
(deepspeed_engine.py) and its config (deepspeed_config.py), the memory plan (memory_plan.py)."""
