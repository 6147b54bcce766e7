"""vLLM as the trainers' sampler: an in-process engine, and G completions per prompt with their log-probs.

Used by grpo_vllm_one.py's generation worker, tools/probe.py, evaluate-style benches and tests. vLLM's INFO
and WARNING lines stay out of their output (quiet_vllm) unless VLLM_LOGGING_LEVEL asks for them.
"""
import os

import torch

from simple_grpo.devices import vllm_memory_share
from simple_grpo.task.problems import stop_token_ids


CPU_BLOCK_SIZE = 32  # tokens per KV-cache block on a CPU (vLLM's CPU default: 128)
# sampler_logps where vLLM gave no log-prob (past a completion's end): a real log-prob is <= 0, and vLLM reports
# exactly 0.0 for a token it is sure of, so 0 cannot mark padding. Finite, so a gap times a mask stays 0 there and
# the wire's finite check (protocol.check_rollout) passes it; every use masks it or counts it (run/doctor.py).
NO_LOGP = 1.0


def quiet_vllm():
    """vLLM logs only its errors, unless the user set VLLM_LOGGING_LEVEL (vLLM's own variable:
    VLLM_LOGGING_LEVEL=INFO shows its start-up notes and warnings, a third of a real demo's lines). vLLM
    reads the variable when it sets up its logging (vllm 0.32: as an engine starts), and the processes it
    starts inherit it: call this before."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def start_vllm(cfg, compile=False, block_size=None, max_seqs=None):
    """An in-process vLLM engine (no engine subprocess: weights can be handed to it directly)
    that reports the log-probs of sampled tokens after temperature, as the trainer computes them.
    On a CPU the model runs eagerly unless compile: torch.compile then takes ~25 s more at
    start-up for 10-20% faster sampling (on a GPU vLLM always compiles and captures CUDA graphs).

    The G completions of a prompt share its KV cache through vLLM's prefix caching, one whole
    block at a time. On a CPU vLLM's blocks are 128 tokens unless set, and a prompt shorter than
    that (the tiny task's are about 110-150 tokens) would run G times over; blocks of CPU_BLOCK_SIZE
    share all of it but its last few tokens (bench/sampling.py measures both). block_size: None is CPU_BLOCK_SIZE on
    a CPU and vLLM's own default on a GPU (16).

    max_seqs: the most sequences vLLM decodes at once (its max_num_seqs; None: vLLM's default, 1024 on an
    H100/H200). The trainer passes its batch's completions: vLLM sizes its start-up profile by it, and at
    1024 the profile's sampler pass over (1024, vocab) float32 logits takes ~3 GB of the GPU share that the
    memory plan gives to KV cache (seen on an H100 with Qwen's 151,936-token vocabulary: docs/gpu_notes.md)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    quiet_vllm()
    from vllm import LLM
    if block_size is None and not torch.cuda.is_available():
        block_size = CPU_BLOCK_SIZE
    return LLM(model=cfg.model, dtype=cfg.dtype, seed=cfg.seed, tensor_parallel_size=cfg.gen_tp,
               enforce_eager=not (torch.cuda.is_available() or compile), max_model_len=cfg.max_model_len,
               gpu_memory_utilization=vllm_memory_share(cfg.gen_memory, shared_gpu=True),
               logprobs_mode="processed_logprobs", **({"block_size": block_size} if block_size else {}),
               **({"max_num_seqs": max_seqs} if max_seqs else {}))


def stop_vllm(llm):
    """Shut an in-process engine down before its process exits: its executor, then the torch.distributed
    groups it set up. Left alive, on CUDA its NCCL group outlives the interpreter and torch warns at exit
    that destroy_process_group() was not called."""
    llm.llm_engine.engine_core.shutdown()  # the in-process engine core (newer vLLM also destroys its groups)
    from vllm.distributed import cleanup_dist_env_and_memory
    cleanup_dist_env_and_memory()  # vLLM's groups (tensor-parallel, world), then the default one
    if torch.distributed.is_initialized():  # whatever vLLM version left it
        torch.distributed.destroy_process_group()


def sample(llm, prompts, cfg, stop_ids=None):
    """G completions per prompt, each ending at its first stop token: prompt rows [(P,)], completion_ids
    (Q*G, C) right-padded with pad, and the sampler's per-token log-probs sampler_logps (Q*G, C) right-padded
    with NO_LOGP, group after group. stop_ids: None is stop_token_ids for cfg.model, the set the trainers'
    masks use. vLLM adds the tokenizer's EOS and the generation config's eos ids to any stop set; a completion
    it ends at an id outside stop_ids would look cut off to the masks (its padded tail trained), so that stops
    the run."""
    from vllm import SamplingParams
    if stop_ids is None:
        stop_ids = stop_token_ids(llm.get_tokenizer(), cfg.prompt_format, cfg.model)
    params = SamplingParams(n=cfg.num_generations, temperature=cfg.temperature, max_tokens=cfg.max_new_tokens,
                            min_tokens=cfg.min_new_tokens, stop_token_ids=list(stop_ids),
                            logprobs=0,  # just the sampled token's
                            detokenize=False)  # token ids are all we use: no text, no per-token decoding
    outputs = llm.generate(prompts, params, use_tqdm=False)
    pad = llm.get_tokenizer().pad_token_id
    completions = [c for out in outputs for c in out.outputs]
    unknown = [c.token_ids[-1] for c in completions
               if c.finish_reason == "stop" and c.token_ids and c.token_ids[-1] not in stop_ids]
    if unknown:
        raise RuntimeError(f"vLLM ended {len(unknown)} of {len(completions)} completions at token ids "
                           f"{sorted(set(unknown))}, outside the stop set {list(stop_ids)} the trainer's masks use: "
                           "their padded tails would be trained. Pass stop_token_ids(tokenizer, prompt_format, model) "
                           "as stop_ids")
    C = max(len(c.token_ids) for c in completions)
    completion_ids = torch.full((len(completions), C), pad, dtype=torch.long)
    sampler_logps = torch.full((len(completions), C), NO_LOGP)
    for i, c in enumerate(completions):
        completion_ids[i, :len(c.token_ids)] = torch.tensor(c.token_ids)
        sampler_logps[i, :len(c.token_ids)] = torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
    prompt_rows = [torch.tensor(out.prompt_token_ids) for out in outputs]
    return prompt_rows, completion_ids, sampler_logps
