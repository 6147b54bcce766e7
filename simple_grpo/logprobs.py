"""grpo_math.completion_logps's per-token log-probs (and entropy) in less time and memory: a group's prompt runs
once for its G completions, the log-softmax a chunk of rows at a time (ChunkedLogProbs)."""
import torch

from simple_grpo.devices import auto_device, auto_dtype


class ChunkedLogProbs(torch.autograd.Function):
    """log softmax(logits / T)[token_ids] and its gradient, a chunk of rows at a time (float32 temporaries of one
    chunk, not (N, V)). Backward recomputes the softmax from the saved logsumexp, d logp_t / d logit_v =
    (1[v = t] - softmax_v) / T, written over the logits where autograd made them whole (sequence_logps' cat)."""

    @staticmethod
    def forward(ctx, logits, token_ids, temperature, chunk_rows):
        V = logits.size(-1)
        rows, ids = logits.reshape(-1, V), token_ids.reshape(-1, 1)
        lse = torch.empty(rows.size(0), device=logits.device)
        logps = torch.empty(rows.size(0), device=logits.device)
        for i in range(0, rows.size(0), chunk_rows):
            x = rows[i:i + chunk_rows].float() / temperature
            lse[i:i + chunk_rows] = torch.logsumexp(x, dim=-1)
            logps[i:i + chunk_rows] = x.gather(-1, ids[i:i + chunk_rows]).squeeze(-1) - lse[i:i + chunk_rows]
        ctx.save_for_backward(logits, token_ids, lse)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        ctx.overwrite = logits.grad_fn is not None and logits._base is None and logits.is_contiguous()
        return logps.view(token_ids.shape)

    @staticmethod
    def backward(ctx, grad_logps):
        logits, token_ids, lse = ctx.saved_tensors
        V, c = logits.size(-1), ctx.chunk_rows
        rows, ids = logits.reshape(-1, V), token_ids.reshape(-1, 1)
        grad = rows if ctx.overwrite else torch.empty_like(rows)
        g = grad_logps.reshape(-1, 1).float() / ctx.temperature
        in_place = grad.dtype == torch.float32  # then each chunk's gradient is computed where it goes
        for i in range(0, rows.size(0), c):
            d = torch.div(rows[i:i + c], ctx.temperature, out=grad[i:i + c] if in_place else None).float()
            d.sub_(lse[i:i + c, None]).exp_().mul_(-g[i:i + c])  # -softmax * g / T
            d.scatter_add_(-1, ids[i:i + c], g[i:i + c])  # + 1[v = t] * g / T
            if not in_place:
                grad[i:i + c] = d
        return grad.view(logits.shape), None, None, None


def selective_log_softmax(logits, token_ids, temperature=1.0, chunk_rows=None):
    """log softmax(logits / temperature)[token_ids], (B, T, V), (B, T) -> (B, T), never holding the whole
    (B, T, V) log-softmax (ChunkedLogProbs). The temperature makes these the sampling distribution's."""
    # ~4M logits (16 MB fp32) at a time on a CPU; on a GPU, 32M: fewer, larger kernels run faster
    chunk_rows = chunk_rows or max(1, (1 << (22 if logits.device.type == "cpu" else 25)) // logits.size(-1))
    return ChunkedLogProbs.apply(logits, token_ids, temperature, chunk_rows)


def prefill_prompts(model, prompt_ids, prompt_mask, copies):
    """Each left-padded prompt run once: the last position's logits and a KV cache holding `copies` copies of each
    prompt, one per completion to come. Positions count real tokens only, as in generation."""
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0),
                use_cache=True, logits_to_keep=1)
    out.past_key_values.batch_repeat_interleave(copies)
    return out


def sequence_logps(model, prompt_ids, prompt_mask, completion_ids, temperature=1.0, impl="torch", entropy=False):
    """Per-token log-probs of the completions under `model`, (Q*G, C) (entropy=True: and token_entropy's). prompt_ids
    (Q, P) left-padded; completion_ids (Q*G, C) right-padded, each prompt's G completions one after another. Each
    prompt runs once (but under gradient checkpointing in training): one forward's numbers, for less work."""
    Q, B, C = prompt_ids.size(0), completion_ids.size(0), completion_ids.size(1)
    if B % Q:
        raise ValueError(f"{B} completions for {Q} prompts: expected the same number per prompt")
    G = B // Q
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    if module.training and getattr(module, "is_gradient_checkpointing", False):
        # checkpointed layers keep no KV cache while training: one forward over prompt + completion
        ids = torch.cat([prompt_ids.repeat_interleave(G, dim=0), completion_ids], dim=1)
        mask = torch.cat([prompt_mask.repeat_interleave(G, dim=0), torch.ones_like(completion_ids)], dim=1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                       use_cache=False, logits_to_keep=C + 1).logits[:, :-1]  # position P-1+t predicts token t
        return log_probs_of(logits, completion_ids, temperature, impl, entropy)
    # 1. the prompts, once each; the last prompt logit predicts the first completion token
    out = prefill_prompts(model, prompt_ids, prompt_mask, G)
    logits = [out.logits.repeat_interleave(G, dim=0)]
    # 2. the completions on G copies of each prompt's cache; token t predicts token t+1
    if C > 1:
        mask = torch.cat([prompt_mask.repeat_interleave(G, dim=0), torch.ones_like(completion_ids)], dim=1)
        positions = prompt_mask.sum(1).repeat_interleave(G)[:, None] + torch.arange(C - 1, device=mask.device)
        logits.append(model(input_ids=completion_ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions,
                            past_key_values=out.past_key_values, use_cache=True).logits)
    return log_probs_of(torch.cat(logits, dim=1), completion_ids, temperature, impl, entropy)


@torch.inference_mode()
def load_reference(cfg):
    """regroup_ver/'s reference server's frozen model (cfg: protocol.ServerConfig), in evaluation mode with no
    gradients; cfg.device and cfg.dtype "auto" resolved here: the first visible GPU in bf16, else the CPU in fp32."""
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(cfg.threads)
    cfg.device = auto_device(cfg.device)
    cfg.dtype = auto_dtype(cfg.dtype, cfg.device)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if cfg.dtype not in dtypes:
        raise SystemExit(f"unknown --dtype {cfg.dtype!r}: use auto, {', '.join(dtypes)}")
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtypes[cfg.dtype]).to(cfg.device).eval()
    return model.requires_grad_(False)


def log_probs_of(logits, token_ids, temperature, impl="torch", entropy=False):
    """log softmax(logits / T)[token_ids] by the torch path or, with impl "triton", one fused
    kernel per pass (triton_loss/): the same numbers. entropy=True: (logps, token_entropy)."""
    if impl == "triton":
        from triton_loss import selective_log_softmax_triton
        logps = selective_log_softmax_triton(logits, token_ids, temperature)
    else:
        logps = selective_log_softmax(logits, token_ids, temperature)
    return (logps, token_entropy(logits, temperature)) if entropy else logps


@torch.no_grad()
def token_entropy(logits, temperature=1.0, chunk_rows=None):
    """The entropy -sum_v p_v log p_v of each position's sampling distribution p = softmax(logits / T), (B, T, V)
    -> (B, T), a few rows at a time: H = logsumexp(x) - sum_v p_v x_v, x = logits / T. A diagnostic, no gradient."""
    V = logits.size(-1)
    rows = logits.reshape(-1, V)
    chunk_rows = chunk_rows or max(1, (1 << 22) // V)
    out = torch.empty(rows.size(0), device=logits.device)
    for i in range(0, rows.size(0), chunk_rows):
        x = rows[i:i + chunk_rows].float() / temperature
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        out[i:i + chunk_rows] = lse.squeeze(-1) - (torch.exp(x - lse) * x).sum(-1)
    return out.view(logits.shape[:-1])
