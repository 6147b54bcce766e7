"""The sampling side: vLLM (vllm_sampler.py) and transformers (hf_sampler.py) samplers, grpo_vllm_one's worker
processes (workers.py), their flags (config.py) and batch schedule (schedule.py), the weight channel
(weight_sync.py), and what the trainer shows while it waits (progress.py)."""
