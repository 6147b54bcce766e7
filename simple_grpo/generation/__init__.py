"""The sampling side: the vLLM and transformers samplers, grpo_vllm_one's worker processes and weight sync."""
