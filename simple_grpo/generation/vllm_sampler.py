"""vLLM as a sampler (grpo_vllm_one.py's generation worker, evaluate.py, tools, benches): an in-process engine, and
G completions per prompt with their log-probs."""
import os

import torch

from simple_grpo.devices import vllm_memory_share
from simple_grpo.task.problems import make_prompt, stop_token_ids


CPU_BLOCK_SIZE = 32  # tokens per KV-cache block on a CPU (vLLM's default: 128): G completions share whole blocks
# sampler_logps past a completion's end: not 0, a log-prob vLLM gives a sure token; finite, so times a mask it is 0
NO_LOGP = 1.0


def generated_lengths(sampler_logps):
    """(Q*G,) the tokens vLLM generated in each completion: its log-probs (<= 0) end there, NO_LOGP after. The masks
    keep nothing past them (grpo_math.completion_mask's lengths), whatever token pads the row."""
    return (sampler_logps != NO_LOGP).sum(1)


def check_context_length(cfg, problems, tokenizer):
    """Before vLLM starts: stop where a prompt of the data alone fills vLLM's context (--max_model_len; vLLM refuses
    such a request and the worker would die on it), and say how many prompts leave less room than --max_new_tokens
    (vLLM ends those completions at the context's end: truncated, counted in metrics.jsonl as context_cut_frac)."""
    prompts = [make_prompt(tokenizer, p["question"], cfg.prompt_format, cfg.system_prompt) for p in problems]
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=True)["input_ids"]]  # as vLLM tokenizes
    longest, context = max(lengths), cfg.max_model_len
    if (full := sum(n >= context for n in lengths)):
        raise SystemExit(f"{full} of the {len(lengths)} prompts of {cfg.dataset} are {context} tokens or longer "
                         f"(the longest {longest}): vLLM's context, --max_model_len {context}, has no room for a "
                         f"completion. Raise --max_model_len to {longest + cfg.max_new_tokens} (the longest prompt + "
                         f"--max_new_tokens), or leave those problems out")
    if (short := sum(n + cfg.max_new_tokens > context for n in lengths)):
        print(f"note: {short} of the {len(lengths)} prompts of {cfg.dataset} are longer than --max_model_len {context} "
              f"- --max_new_tokens {cfg.max_new_tokens} = {context - cfg.max_new_tokens} tokens (the longest "
              f"{longest}): vLLM ends their completions at the context's end, cut off like those that reach "
              f"--max_new_tokens (context_cut_frac in metrics.jsonl; --mask_truncated_completions trains none of "
              f"them). --max_model_len {longest + cfg.max_new_tokens} holds every prompt and --max_new_tokens")


def quiet_vllm():
    """vLLM logs only its errors unless VLLM_LOGGING_LEVEL is set (INFO: its start-up notes and warnings too).
    Call it before an engine starts: vLLM reads the variable then, and the processes it starts inherit it."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def start_vllm(cfg, compile=False, block_size=None, max_seqs=None):
    """An in-process vLLM engine (weights can be handed to it directly) that reports the log-probs of sampled
    tokens after temperature, as the trainer computes them; on a CPU eager unless compile. block_size: None is
    CPU_BLOCK_SIZE on a CPU, vLLM's default on a GPU. max_seqs: vLLM's max_num_seqs (None: its default)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    quiet_vllm()
    from vllm import LLM
    return LLM(**engine_args(cfg, compile, block_size, max_seqs))


def engine_args(cfg, compile=False, block_size=None, max_seqs=None):
    """start_vllm's arguments to vllm.LLM (grpo_vllm_one.py's vllm_args, its copy, is held equal to them)."""
    if block_size is None and not torch.cuda.is_available():
        block_size = CPU_BLOCK_SIZE
    return dict(model=cfg.model, dtype=cfg.dtype, seed=cfg.seed, tensor_parallel_size=cfg.gen_tp,
                enforce_eager=not (torch.cuda.is_available() or compile), max_model_len=cfg.max_model_len,
                gpu_memory_utilization=vllm_memory_share(cfg.gen_memory, shared_gpu=True),
                logprobs_mode="processed_logprobs", **({"block_size": block_size} if block_size else {}),
                **({"max_num_seqs": max_seqs} if max_seqs else {}))


def sampling_args(cfg, stop_ids):
    """sample's SamplingParams: G completions a prompt from softmax(logits / T), each to its first stop token."""
    return dict(n=cfg.num_generations, temperature=cfg.temperature, max_tokens=cfg.max_new_tokens,
                **({"min_tokens": cfg.min_new_tokens} if cfg.min_new_tokens else {}), stop_token_ids=list(stop_ids),
                logprobs=0,  # just the sampled token's
                detokenize=False)  # token ids are all we use: no text, no per-token decoding


def stop_vllm(llm):
    """Shut an in-process engine down before its process exits: its engine core, then the torch.distributed
    groups (vLLM's and the default one; left alive, torch warns at exit that they were not destroyed)."""
    llm.llm_engine.engine_core.shutdown()
    from vllm.distributed import cleanup_dist_env_and_memory
    cleanup_dist_env_and_memory()


def sample(llm, prompts, cfg, stop_ids=None):
    """G completions per prompt, group after group, each ending at its first stop token: prompt rows [(P,)],
    completion_ids (Q*G, C) right-padded with pad, and vLLM's log-probs sampler_logps (Q*G, C) right-padded with
    NO_LOGP. stop_ids: None is stop_token_ids, the masks' set. vLLM adds its own EOS ids to any stop set: a
    completion ended by one outside stop_ids would look cut off to the masks, so that stops the run."""
    from vllm import SamplingParams
    if stop_ids is None:
        stop_ids = stop_token_ids(llm.get_tokenizer(), cfg.prompt_format, cfg.model)
    params = SamplingParams(**sampling_args(cfg, stop_ids))
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
