"""--plan: what a GRPO run will need on its GPUs and host, from the model's config alone, as a table and one JSON
line (GB: 10^9 bytes; docs/gpu_notes.md checks it against runs), e.g. for 8 training ranks on one node:
    WORLD_SIZE=8 python -m simple_grpo.train --plan --model configs/qwen2.5-7b --dtype bfloat16 --zero_stage 2"""
import functools
import json
import math
import os

from simple_grpo.devices import generation_gpus, physical_gpus, visible_gpus, vllm_memory_share

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
BUCKET_ELEMENTS = 5e8  # DeepSpeed's reduce_bucket_size default: one gradient bucket this long
VLLM_RUNTIME = 2 * GB  # vLLM beyond weights and KV cache: profiled activations, CUDA graphs, sampler
PROCESS_RUNTIME = 3 * GB  # host memory of a trainer rank or vLLM worker beyond the counted buffers: CUDA, libraries
LOGPROB_CHUNK = 2 ** 25  # logits a chunk of logprobs.py's ChunkedLogProbs on a GPU
VLLM_CONTEXT = 0.5 * GB  # vLLM's CUDA context: made before it measures the GPU, so outside its --gen_memory share


@functools.lru_cache(maxsize=None)
def count_parameters(model):
    """Exact parameter count (tied weights once) and the sizes the estimates need, from a HF
    directory or config.json; the model is built on the meta device, so no weight is read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    path = os.path.dirname(model) or "." if model.endswith(".json") else model
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)  # a hub name: from the local cache only
    except (OSError, ValueError) as e:
        where = "is not a model config" if os.path.exists(path) else "does not exist here (nor in the HF cache)"
        raise ValueError(f"model {model!r} {where}: point --model at a local HF directory or its config.json; "
                         f"the plan reads the config alone (configs/ holds Qwen2.5's) [{type(e).__name__}]") from None
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config)
    heads = config.num_attention_heads
    return {"architecture": type(net).__name__,
            "params": sum(p.numel() for p in net.parameters()),  # parameters() yields a tied weight once
            "largest_layer_params": max(sum(p.numel() for p in m.parameters(recurse=False)) for m in net.modules()),
            "hidden": config.hidden_size, "layers": config.num_hidden_layers, "vocab": config.vocab_size,
            "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
            "intermediate": config.intermediate_size, "model_type": config.model_type,
            "linears": tuple((name.rsplit(".", 1)[-1], mod.in_features, mod.out_features)
                             for name, mod in net.named_modules() if isinstance(mod, torch.nn.Linear)),
            "numels": tuple(p.numel() for p in net.parameters())}  # each parameter's size (tied ones once)


def pinned(nbytes):
    """What a page-locked host buffer of nbytes takes: torch's CUDA host allocator (pin_memory) rounds every
    allocation up to a power of two (ATen/core/CachingHostAllocator.h), so a 12.3 GB fp32 partition takes 17.2."""
    return 2 ** math.ceil(math.log2(nbytes)) if nbytes > 0 else 0


def adapted_linears(cfg, m):
    """(in, out) of each linear layer LoRA adapts: PEFT's per-architecture default, a list of names, or
    all-linear (every linear layer but the output head)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS
    from simple_grpo.lora import target_modules
    targets = target_modules(cfg.lora_target_modules) or DEFAULTS.get(m["model_type"])
    if targets is None:
        raise ValueError(f"PEFT has no default LoRA targets for {m['model_type']}: pass --lora_target_modules")
    return [(i, o) for name, i, o in m["linears"]
            if (name != "lm_head" if targets == "all-linear" else name in targets)]


def lora_parameters(cfg, m):
    """The adapters' trainable parameters: r * (in + out) for each linear layer LoRA adapts."""
    return sum(cfg.lora_r * (i + o) for i, o in adapted_linears(cfg, m))


def lora_merge_bytes(cfg, m, d):
    """What the weight sync holds on the GPU with LoRA: weight_sync.merged_weights makes one merged weight at a time, and
    WeightSender.send copies it to the host and lets it go before the next is made. For the largest adapted weight:
    PEFT's get_delta_weight makes B @ A and its scaled copy (d bytes each), then W + that delta is a new d-byte
    tensor beside it; two at once either way."""
    return 2 * d * max((i * o for i, o in adapted_linears(cfg, m)), default=0)


def model_states(P, L, d, stage, offload, N):
    """Bytes on one training GPU (weights, gradients, optimizer), and on the host per rank. Per parameter (P
    parameters, N training ranks, d = 2 for bfloat16 or 4 for float32, L = the largest module's parameters), as
    DeepSpeed 0.19.8 holds them with AdamW (runtime/zero/stage_1_and_2.py, stage3.py, engine.py):

                     weights      gradients      optimizer: fp32 master + Adam m, v
      ZeRO-0 float32     4            4              0 + 8        (torch AdamW updates the weights themselves)
      ZeRO-0 bfloat16    2            2 + 4          4 + 8        (step() makes fp32 copies of the gradients)
      ZeRO-1             d            d + 4/N        (4 + 8)/N    (float32 too: the master is a clone)
      ZeRO-2             d            (d + 4)/N      (4 + 8)/N    d = 2: DeepSpeed's estimator, 2 + 18/N
      ZeRO-3             d/N + dL/P   dL/P + 4/N     (4 + 8)/N    d = 2: its estimator, (4L + 18P/N)/P
      + offload          the fp32 gradients, master and Adam go to the host: 16/N a rank

    ZeRO-3 float32 without offload keeps no master copy (its fp32 partition is the weights). What step() holds
    beyond this (ZeRO-1/2 flatten the 16-bit gradient partition once more) is in plan_memory's margin."""
    host = 16 * P / N if offload else 0  # fp32 gradients, master and Adam m, v of this rank's partition
    if stage == 0:
        fp32_copies = 4 if d == 2 else 0
        return {"weights": d * P, "gradients": (d + fp32_copies) * P, "optimizer": (fp32_copies + 8) * P}, host
    master = 0 if (stage == 3 and d == 4 and not offload) else 4
    optimizer = 0 if offload else (master + 8) * P / N
    fp32_grads = 0 if offload else 4 * P / N
    if stage == 3:
        return {"weights": d * P / N + d * L, "gradients": d * L + fp32_grads, "optimizer": optimizer}, host
    grads16 = d * P if stage == 1 else (0 if offload else d * P / N)  # ZeRO-1 keeps them whole until the step
    return {"weights": d * P, "gradients": grads16 + fp32_grads, "optimizer": optimizer}, host


def activation_bytes(m, d, seqs, seq_len, completion_len, checkpointing, lora_inputs=0, chunk=LOGPROB_CHUNK):
    """The most autograd and the log-prob pass hold at once for one forward/backward of `seqs` sequences of
    `seq_len` tokens (simple_grpo/logprobs.py's sequence_logps, then the loss and backward).

    Per token and layer, what backward needs: q, k, v before and after rotary, the attention output, the MLP's
    gate, up, silu(gate) and their product (4I), d bytes each, and the two RMSNorms' fp32 intermediates (16h
    bytes); no (T, T) scores (sdpa/flash attention recompute them). LoRA with dropout adds dropout's output
    (d bytes) and its mask (a bool: CUDA's fused dropout) for each of the adapted layers' `lora_inputs` input
    elements a token (q, k and v each drop their shared input apart); what the frozen base keeps no input for is
    not taken off, so full training's count stays an upper bound there. While a layer's backward runs, the
    gradients of its MLP's gate and up (2I, d bytes) come on top.

    The logits, (completion tokens, vocab) in d bytes: without checkpointing sequence_logps runs the prompt
    once and its completions on its KV cache, and the lm_head's output and the torch.cat of the two parts both
    live at the end of the forward (ChunkedLogProbs then writes the gradient over the cat). With checkpointing
    it runs one forward over prompt + completion and slices the (C + 1) logits it keeps to a view, which
    ChunkedLogProbs cannot write over: its backward holds the lm_head's output, a contiguous copy of the view's
    rows and the new gradient, three at once. The log-softmax's loop adds up to three float32 chunks of
    `chunk` logits (two in a float32 run).

    Without checkpointing every layer's activations live while the logits do. With it only each layer's input
    (h) stays, with the last RMSNorm's fp32 intermediates (8h bytes; it is outside the layers), and the logits'
    phase (first in backward) and a recomputed layer's (after it) come one after the other: the larger counts."""
    tokens, h, I, V = seqs * seq_len, m["hidden"], m["intermediate"], m["vocab"]
    # per token and layer
    attention_elements = 10 * h + 4 * m["kv_heads"] * m["head_dim"]  # q, k, v before and after rotary, its output
    mlp_elements = 4 * I  # gate, up, silu(gate), their product
    norm_bytes = 16 * h  # the two RMSNorms' float32 intermediates
    lora_dropout_bytes = (d + 1) * lora_inputs  # dropout's output (d bytes) and its bool mask
    layer = d * (attention_elements + mlp_elements) + norm_bytes + lora_dropout_bytes
    layer_backward = 2 * d * I  # the gradients of the MLP's gate and up while its backward runs
    rows = seqs * (completion_len + 1 if checkpointing else completion_len)
    # the logits' copies: the lm_head's output and the cat; with checkpointing it, a copy and the gradient
    logits_copies = 3 if checkpointing else 2
    float32_chunks = 3 if d == 2 else 2  # the log-softmax's loop: a bf16 chunk's float32 copy too
    logits = logits_copies * rows * V * d + float32_chunks * 4 * min(chunk, rows * V)
    if checkpointing:
        last_norm_bytes = 8 * h  # the final RMSNorm's float32 intermediates, outside the layers
        return tokens * (m["layers"] * d * h + last_norm_bytes) + max(tokens * (layer + layer_backward), logits)
    return m["layers"] * tokens * layer + max(logits, tokens * layer_backward)


def update_activations(cfg, m, d, seqs, seq_len, chunk=LOGPROB_CHUNK):
    """activation_bytes for a trainer's config: its checkpointing, and LoRA's dropout on the inputs of the
    layers it adapts (per layer) where it has any."""
    from simple_grpo.lora import lora_dropout
    lora_inputs = sum(i for i, _ in adapted_linears(cfg, m)) / m["layers"] \
        if cfg.use_peft and lora_dropout(cfg) > 0 else 0
    return activation_bytes(m, d, seqs, seq_len, cfg.max_new_tokens, cfg.gradient_checkpointing, lora_inputs, chunk)


def detected_gpu_gb():
    import torch
    if not torch.cuda.is_available():
        raise ValueError("no GPU here to size the plan against: pass the training GPU's memory, e.g. --plan_gpu_gb 80")
    return torch.cuda.get_device_properties(0).total_memory / GB


def vllm_shares_training_gpu(cfg, world_size):
    """Whether the full trainer's vLLM will run on a training GPU of this node, and the layout in words:
    for --plan_gpus N GPUs (the first world_size of them train), else for this machine's; with neither,
    vLLM is planned on a GPU of its own."""
    gpus = list(range(cfg.plan_gpus)) if cfg.plan_gpus else physical_gpus()
    if not gpus:
        return False, "vLLM on a GPU of its own (--plan_gpus N plans for a node of N GPUs)"
    trainer = (gpus if cfg.plan_gpus else visible_gpus(gpus))[:world_size]
    ids, shared = generation_gpus(cfg.gen_device, cfg.gen_tp, trainer, gpus)
    return shared, (f"{len(gpus)} GPU(s): training on {trainer}, vLLM on {ids}"
                    + (", sharing the training GPU" if shared else ""))


def plan_memory(cfg, world_size=1, gpu_gb=None):
    """The plan for a trainer's config `cfg` (simple_grpo.train's; one without vLLM's flags samples on its training
    GPU, as grpo_train.py does): bytes per row for the
    training GPU, the generation GPU and the host, `fits`, `reasons` (why, and what to change) and the
    summary keys of plan_json.

    The training GPU holds the model states (model_states; with LoRA the frozen base holds weights only), the
    largest of the transient rows, which come one after another (the update's activations; the weight sync's,
    one weight at a time: with LoRA one merged weight, under ZeRO-3 one module gathered whole; a ZeRO-3
    checkpoint's save, every parameter gathered at once), a margin, and where vLLM shares the GPU its --gen_memory
    share and CUDA context. The host holds the larger of the checkpoint's load (d bytes a parameter on every
    rank) and a step's buffers: under ZeRO-1/2 offload the page-locked fp32 master and gradients and a d-byte
    copy (pinned()), a page-locked buffer that sums the gradients over several passes, the weight sync's two
    shared copies, a checkpoint save's copy; and PROCESS_RUNTIME a process. Not counted: the ref server's model."""
    dtype, stage, offload = cfg.dtype, cfg.zero_stage, cfg.offload_optimizer
    checkpointing = cfg.gradient_checkpointing
    uses_vllm = hasattr(cfg, "gen_memory")  # simple_grpo.train; without it, generation on the training GPU
    tp = cfg.gen_tp if uses_vllm else 1
    shared, layout = vllm_shares_training_gpu(cfg, world_size) if uses_vllm else (False, "no vLLM")
    gen_memory = vllm_memory_share(cfg.gen_memory if uses_vllm else 0.0, shared_gpu=shared)
    prompts, G, per_part = cfg.batch_prompts, cfg.num_generations, cfg.micro_batch_groups
    new_tokens = cfg.max_new_tokens
    seq_len = cfg.max_model_len if uses_vllm else new_tokens + 512  # no vLLM, no such limit: prompts of up to 512
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one the trainers use: pass float32 or bfloat16")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage {stage!r}: DeepSpeed's ZeRO stages are 0, 1, 2 and 3")
    if offload and stage == 0:
        raise ValueError("offload_optimizer needs ZeRO: pass --zero_stage 2 (or 1, 3) with it")
    if new_tokens >= seq_len:
        raise ValueError(f"max_new_tokens {new_tokens} leaves no room for a prompt in max_model_len {seq_len}: "
                         "raise --max_model_len")
    gpu_gb = gpu_gb or cfg.plan_gpu_gb or detected_gpu_gb()
    m, d, N, gpu = count_parameters(cfg.model), DTYPE_BYTES[dtype], world_size, gpu_gb * GB
    P, L = m["params"], m["largest_layer_params"]
    A = lora_parameters(cfg, m) if cfg.use_peft else P  # the parameters that train

    # ALGO LOGIC: one training GPU
    trainer, host_per_rank = model_states(A, 0 if cfg.use_peft else L, d, stage, offload, N)
    if cfg.use_peft:  # the frozen base: weights only, partitioned under ZeRO-3 like the rest
        trainer["weights"] += d * P / N + d * L if stage == 3 else d * P
    seqs = min(per_part or prompts, prompts) * G  # sequences in one forward/backward
    trainer["activations"] = update_activations(cfg, m, d, seqs, seq_len)
    # the weight sync, after the update, one module at a time: ZeRO-3 gathers the largest module's parameters
    # whole (a LoRA layer's adapters beside them, r * (in + out), are in the margin); LoRA merges one weight
    trainer["weight_sync"] = ((d * L if stage == 3 else 0) + (lora_merge_bytes(cfg, m, d) if cfg.use_peft else 0)) \
        if uses_vllm else 0
    trainer["checkpoint"] = d * P if stage == 3 else 0  # a save under ZeRO-3 gathers every parameter at once
    # these come one after another, not at once: the largest counts
    transient = max(trainer["activations"], trainer["weight_sync"], trainer["checkpoint"])
    # ZeRO-1/2 take a bucket of reduce_bucket_size elements for every backward whatever trains (setup_buckets)
    bucket = d * (min(BUCKET_ELEMENTS, A) if stage == 0 or (cfg.use_peft and stage == 3) else BUCKET_ELEMENTS)
    step_copy = d * A / N if stage and not offload else 0  # what step() holds beyond the estimators (docstring)
    # CUDA context and cuBLAS/NCCL workspaces, a gradient bucket, step()'s copy, allocator fragmentation
    trainer["margin"] = 1 * GB + bucket + step_copy + 0.1 * transient
    trainer["vllm_share"] = gen_memory * gpu_gb * GB if shared else 0  # vLLM takes it first (workers.wait_for_vllm)
    trainer["vllm_context"] = VLLM_CONTEXT if shared else 0  # its process's, outside that share
    trainer["total"] = sum(trainer[row] for row in ("weights", "gradients", "optimizer", "margin", "vllm_share",
                                                    "vllm_context")) + transient

    # ALGO LOGIC: the generation GPU, per vLLM tensor-parallel rank; weights and KV cache in `dtype`
    full_batch = prompts * G
    kv_per_token = 2 * m["layers"] * max(m["kv_heads"] / tp, 1) * m["head_dim"] * d  # K and V
    gen = {"takes": gen_memory * gpu, "weights": P * d / tp, "kv_cache": full_batch * seq_len * kv_per_token,
           "runtime": VLLM_RUNTIME}
    gen["needs"] = gen["weights"] + gen["kv_cache"] + gen["runtime"]
    least = math.ceil(gen["needs"] / gpu * 100) / 100  # the smallest gen_memory that holds it

    # ALGO LOGIC: host RAM of the node (all `world_size` ranks on it)
    passes = math.ceil(prompts / min(per_part or prompts, prompts))  # forward/backward passes per step
    host = {"load": d * P * N, "optimizer_offload": host_per_rank * N, "staging": 0, "accumulation": 0}
    if offload and stage < 3:  # ZeRO-1/2 (stage_1_and_2.py): the fp32 master and gradients and a d-byte copy of
        a = A / N  # each rank's partition are page-locked (rounded up); Adam's m and v are not
        host["optimizer_offload"] = N * (2 * pinned(4 * a) + 8 * a)
        host["staging"] = N * (pinned(d * a) + pinned(d * max(m["numels"])))  # and the largest gradient's buffer
        if passes > 1:  # a page-locked d-byte buffer per parameter holds the gradients summed over the passes
            host["accumulation"] = 2 * d * A if cfg.use_peft else sum(pinned(d * n) for n in m["numels"])
    senders = math.ceil(N / (cfg.gen_every or N)) if uses_vllm else 0  # ranks that run generation workers
    host["weight_sync"] = senders * 2 * d * P  # generation/weight_sync.py: two shared buffers of the weights
    host["checkpoint"] = d * P  # a save: DeepSpeed's copy of the module's state, then save_pretrained's
    processes = N + senders * (cfg.gen_workers if uses_vllm else 0)
    host["runtime"] = processes * PROCESS_RUNTIME
    host["model_states"] = max(4 * P * N, host_per_rank * N)  # what DeepSpeed's estimators count
    host["step"] = sum(host[row] for row in ("optimizer_offload", "staging", "accumulation", "weight_sync",
                                             "checkpoint"))
    host["total"] = max(host["load"], host["step"]) + host["runtime"]

    reasons = [f"trainer needs {trainer['total'] / GB:.1f} GB of the {gpu_gb:.0f} GB training GPU"
               + (f", vLLM's --gen_memory {gen_memory} share included" if shared else "")]
    if trainer["total"] > gpu:
        tries = (["--dtype bfloat16"] if d == 4 else []) \
            + ([("--zero_stage 2 " if stage == 0 else "") + "--offload_optimizer"] if not offload else []) \
            + (["--gradient_checkpointing"] if not checkpointing else []) \
            + (["--micro_batch_groups 1"] if seqs > G else []) + (["--use_peft"] if not cfg.use_peft else []) \
            + (["--zero_stage 3 with more ranks"] if N < 8 else [])
        tries += [f"a GPU of its own for vLLM (--gen_device; now {trainer['vllm_share'] / GB:.1f} GB of this one)"] \
            if shared else []
        reasons[0] += ": try " + ", ".join(tries or ["a GPU with more memory"])
    if not uses_vllm:
        gen = {key: 0 for key in gen}
        reasons.append("generation: on the training GPU (no vLLM), within its activations' share")
    elif gen["needs"] > gen["takes"]:
        tries = ([f"--gen_memory {least}"] if least <= 0.95 else []) + (["--dtype bfloat16"] if d == 4 else []) \
            + (["a GPU with more memory for vLLM (--gen_device)"] if least > 0.5 else [])
        reasons.append(f"vLLM needs {gen['needs'] / GB:.1f} GB (weights {gen['weights'] / GB:.1f}, KV cache for "
                       f"{full_batch} sequences of {seq_len} tokens {gen['kv_cache'] / GB:.1f}, runtime "
                       f"{gen['runtime'] / GB:.0f}) but --gen_memory {gen_memory} gives it {gen['takes'] / GB:.1f} "
                       "GB: try " + ", ".join(tries))
    else:
        reasons.append(f"vLLM needs {gen['needs'] / GB:.1f} GB of the {gen['takes'] / GB:.1f} GB --gen_memory "
                       f"{gen_memory} gives it (--gen_memory {least} would do)")
    fits = trainer["total"] <= gpu and (gen["needs"] <= gen["takes"] or not uses_vllm)
    settings = dict(dtype=dtype, zero_stage=stage, offload_optimizer=offload, gradient_checkpointing=checkpointing,
                    lora=f"r={cfg.lora_r}, {A / 1e6:.1f}M trainable" if cfg.use_peft else None,
                    world_size=N, gpu_gb=gpu_gb, gen_memory=gen_memory, shared_gpu=shared, layout=layout,
                    sequences_per_pass=seqs, seq_len=seq_len,
                    max_new_tokens=new_tokens)
    return {"model": m, **settings, "trainer": trainer, "trainer_gb": {row: b / GB for row, b in trainer.items()},
            "generation": gen, "host": host, "least_gen_memory": least,
            "fits": fits, "reasons": reasons, "trainer_gpu_gb": trainer["total"] / GB,
            "generation_gpu_gb": max(gen["takes"], gen["needs"]) / GB, "host_gb": host["total"] / GB}


def format_plan(plan):
    """A small table: the training GPU's rows, the generation GPU, host RAM; the verdict; what to change."""
    m, t, g, h = plan["model"], plan["trainer"], plan["generation"], plan["host"]
    options = [plan["dtype"], f"ZeRO-{plan['zero_stage']}", f"{plan['world_size']} training rank(s)"] \
        + (["optimizer offload"] if plan["offload_optimizer"] else []) \
        + (["gradient checkpointing"] if plan["gradient_checkpointing"] else []) \
        + ([f"LoRA {plan['lora']}"] if plan["lora"] else [])
    lines = [f"memory plan: {m['architecture']}, {m['params'] / 1e9:.2f}B parameters, " + ", ".join(options),
             f"  {plan['sequences_per_pass']} sequences per forward/backward of up to {plan['seq_len']} tokens "
             f"({plan['max_new_tokens']} new)",
             f"{'training GPU (' + format(plan['gpu_gb'], '.0f') + ' GB), per rank':<36}{'GB':>8}"]
    names = {"weight_sync": "weight sync", "checkpoint": "checkpoint save", "vllm_share": "vLLM (shared GPU)",
             "vllm_context": "vLLM's CUDA context"}
    rows = ("weights", "gradients", "optimizer", "activations") \
        + tuple(row for row in ("weight_sync", "checkpoint") if t[row]) \
        + ("margin",) + (("vllm_share", "vllm_context") if plan["shared_gpu"] else ()) + ("total",)
    after = "   after the update, not beside its activations: the total counts the largest"
    notes = {"weight_sync": after, "checkpoint": after}
    lines += [f"  {names.get(name, name):<34}{t[name] / GB:>8.1f}{notes.get(name, '')}" for name in rows]
    lines += [f"{'generation GPU (vLLM), per tp rank':<36}{'GB':>8}   {plan['layout']}",
              f"  {'takes (gen_memory ' + str(plan['gen_memory']) + ')':<34}{g['takes'] / GB:>8.1f}",
              f"  {'needs':<34}{g['needs'] / GB:>8.1f}   weights {g['weights'] / GB:.1f} + KV cache "
              f"{g['kv_cache'] / GB:.1f} + runtime {g['runtime'] / GB:.1f}",
              f"{'host RAM':<36}{h['total'] / GB:>8.1f}   the larger of loading {h['load'] / GB:.1f} and a step's "
              f"{h['step'] / GB:.1f} (optimizer offload {h['optimizer_offload'] / GB:.1f}, staging "
              f"{h['staging'] / GB:.1f}, accumulation {h['accumulation'] / GB:.1f}, weight sync "
              f"{h['weight_sync'] / GB:.1f}, checkpoint {h['checkpoint'] / GB:.1f}), plus "
              f"{h['runtime'] / GB:.1f} for the processes ({round(h['runtime'] / PROCESS_RUNTIME)} x "
              f"{PROCESS_RUNTIME / GB:.0f})",
              "verdict: " + ("fits" if plan["fits"] else "does NOT fit")]
    return "\n".join(lines + ["  " + reason for reason in plan["reasons"]])


def plan_json(plan):
    """The one-line summary: {"fits", "trainer_gpu_gb", "generation_gpu_gb", "host_gb"}, GB to 0.1, and
    "least_gen_memory", the smallest --gen_memory that holds vLLM (bench/gpu_scale.py gives vLLM that share)."""
    numbers = {key: round(plan[key], 1) for key in ("trainer_gpu_gb", "generation_gpu_gb", "host_gb")}
    return json.dumps({"fits": plan["fits"], **numbers, "least_gen_memory": plan["least_gen_memory"]})


def show_plan(cfg):
    """--plan: print the memory plan and stop. On a GPU, before any weight is loaded: stop a run that cannot fit."""
    import torch
    if not (cfg.plan or torch.cuda.is_available()):
        return
    try:
        plan = plan_memory(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as e:
        if cfg.plan:
            raise SystemExit(f"memory plan: {e}") from None
        print(f"memory plan skipped: {e}")  # e.g. a hub model not downloaded yet: the run goes on
        return
    print(format_plan(plan))
    if cfg.plan:
        print(plan_json(plan))
        raise SystemExit(0)
    if not plan["fits"]:
        raise SystemExit("this run does not fit (memory plan above): change what it says, or check the plan "
                         "for another GPU size with --plan --plan_gpu_gb N")

