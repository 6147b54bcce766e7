"""Sampling with the policy itself (transformers generate, KV cache): tools/explain_step.py's sampler, and the one
grpo_train.py copies (tests/test_grpo_train_copies.py holds them equal). grpo_vllm_one.py and the full trainer sample
with vLLM instead (vllm_sampler.py)."""
import torch
from transformers import GenerationConfig

from simple_grpo.logprobs import prefill_prompts


def generate(model, tokenizer, prompts, cfg, stop_ids, synced_gpus=False):
    """Sample G completions per prompt, each ending at the first of stop_ids. Returns prompt_ids
    (Q, P) left-padded with its mask, and completion_ids (Q*G, C) right-padded with pad, group after group.

    The tokens are drawn from softmax(logits / temperature) over the whole vocabulary, the distribution
    grpo_math.completion_logps computes: generate would take every setting not passed here from the
    model's generation_config.json (Qwen2.5-Instruct's sets repetition_penalty 1.05, top_k 20, top_p 0.8),
    so it runs with a blank one. Only --min_new_tokens (for benchmarks) forbids the stop tokens before
    that length."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left",
                    add_special_tokens=False).to(model.device)
    ids, mask, G = enc["input_ids"], enc["attention_mask"], cfg.num_generations
    was_training = model.training
    model.eval()  # sampling draws from the policy as it is: no dropout
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT wraps the model
    own_config, hf_model.generation_config = hf_model.generation_config, GenerationConfig()
    try:
        with torch.no_grad():
            # the G samples of a prompt share it: run each prompt once (all but its last token, which
            # generate feeds itself) and hand generate G copies of its KV cache
            cache = prefill_prompts(model, ids[:, :-1], mask[:, :-1], G).past_key_values
            out = model.generate(input_ids=ids.repeat_interleave(G, 0), attention_mask=mask.repeat_interleave(G, 0),
                                 past_key_values=cache, do_sample=True, temperature=cfg.temperature, top_k=0,
                                 top_p=1.0, max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.min_new_tokens,
                                 eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id,
                                 synced_gpus=synced_gpus)
    finally:
        hf_model.generation_config = own_config
    model.train(was_training)  # back in the mode the caller had it in
    return ids, mask, out[:, ids.size(1):]
