"""vLLM's log-probs after an in-memory weight sync against a transformers forward of the same weights.

    python tests/sync_check.py float32     # on CUDA where there is one, else on the CPU

Prints one JSON line, {"mean": ..., "max": ...}: |vLLM - transformers| per completion token. It stops vLLM
before it exits (stop_vllm), so the process ends with no warning from torch.distributed.
tests/test_gpu.py runs it on a GPU (fp32 and bf16, vLLM's V1 and V2 model runners), tests/test_gpu_harness.py
on the CPU.
"""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
from grpo_math import completion_mask  # noqa: E402
from simple_grpo.train import Config  # noqa: E402
from simple_grpo.generation.vllm_sampler import sample, start_vllm, stop_vllm  # noqa: E402
from simple_grpo.generation.weight_sync import load_weights  # noqa: E402
from simple_grpo.logprobs import sequence_logps  # noqa: E402
from simple_grpo.task.problems import load_jsonl, make_prompt  # noqa: E402

dtype = sys.argv[1]
device = "cuda" if torch.cuda.is_available() else "cpu"
cfg = Config(model="models/tiny-math", dtype=dtype, batch_prompts=4, num_generations=4, max_new_tokens=40,
             gen_memory=0.3)
llm = start_vllm(cfg)
policy = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, dtype)).to(device).eval()
with torch.no_grad():  # the "trained" weights: a clear change, tied embeddings included
    for p in policy.parameters():
        p.add_(0.02 * torch.randn_like(p))
load_weights(llm, policy.state_dict())  # in memory, from the policy's own tensors, as the trainer's worker loads them
tok = llm.get_tokenizer()
prompts = [make_prompt(tok, p["question"]) for p in load_jsonl(cfg.dataset)[:4]]
prompt_rows, completion_ids, sampler_logps = sample(llm, prompts, cfg)
stop_vllm(llm)
P = max(r.numel() for r in prompt_rows)  # the trainer's left-padded prompts, in the training dtype
prompt_ids = torch.stack([torch.cat([torch.full((P - r.numel(),), tok.pad_token_id), r]) for r in prompt_rows])
prompt_mask = torch.stack([(torch.arange(P) >= P - r.numel()).long() for r in prompt_rows])
with torch.no_grad():
    logps = sequence_logps(policy, prompt_ids.to(device), prompt_mask.to(device), completion_ids.to(device),
                           cfg.temperature)  # (Q*G, C)
mask = completion_mask(completion_ids, tok.eos_token_id).to(device)  # (Q*G, C)
diff = (logps.float() - sampler_logps.to(device)).abs() * mask
print(json.dumps({"mean": diff.sum().item() / mask.sum().item(), "max": diff.max().item()}))
