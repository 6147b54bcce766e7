"""The full trainer's GRPO update (simple_grpo/train.py; grpo_train.py's grpo_step is its default step, plainly):
log-probs, loss, backward and one optimizer step, in micro-batches, on several ranks and iterations."""
import math

import torch

from grpo_math import grpo_loss, loss_denominator
from simple_grpo.devices import max_over_ranks, sum_over_ranks
from simple_grpo.logprobs import sequence_logps
from simple_grpo.run.doctor import sampler_gap_details
from simple_grpo.run.metrics import add_part_stats, stats_over_ranks


def loss_options(cfg):
    """grpo_math.grpo_loss's options, from the flags (named as in TRL's GRPOConfig; how each loss type's
    normalisation differs from TRL's: --loss_type's help, docs/guide.md)."""
    return {"beta": cfg.beta, "epsilon": cfg.epsilon, "epsilon_high": cfg.epsilon_high, "loss_type": cfg.loss_type,
            "importance_sampling_level": cfg.importance_sampling_level, "kl_estimator": cfg.kl_estimator,
            "max_completion_length": cfg.max_new_tokens, "impl": cfg.loss_impl}


def optimizer_step(engine, loss):
    """engine.step() (trainer/deepspeed_engine.py), dropped where the loss or the gradients hold a NaN or inf, which
    Adam's moments would carry to every weight (ZeRO 1-3 check their partitioned gradients in step() themselves).
    Returns the gradients' norm before clipping (ZeRO 0; None under ZeRO 1-3) and whether the step was taken."""
    grads = [p.grad.norm() for p in engine.module.parameters() if p.grad is not None]  # ZeRO 0: whole here
    norm = torch.stack(grads).norm().item() if grads else None
    if norm is not None and not (math.isfinite(norm) and math.isfinite(loss)):
        engine.optimizer.zero_grad(set_to_none=True)
        return norm, False
    engine.step()
    return norm, engine.was_step_applied()


def step_stats(engine, norm, skipped, iterations):
    """What the optimizer says of a step, for the log: lr, grad_norm (None: no update was taken), skipped_updates."""
    norm = norm if norm is not None else float(engine.get_global_grad_norm() or 0.0)
    return {"lr": engine.get_lr()[0], "grad_norm": None if skipped == iterations else norm,
            "skipped_updates": int(skipped)}


def micro_batches(batch, cfg):
    """The batch's group size G and the (first, end) group ranges of its forward/backward passes:
    cfg.micro_batch_groups groups each (0: all in one)."""
    Q = batch["prompt_ids"].size(0)
    per_part = cfg.micro_batch_groups or Q
    return batch["completion_ids"].size(0) // Q, [(q, min(q + per_part, Q)) for q in range(0, Q, per_part)]


def reference_logps(engine, batch, cfg):
    """With LoRA (--use_peft), the reference's per-token log-probs of the batch's completions, (Q*G, C): this
    model with its adapters off, i.e. the frozen base, in evaluation mode (no dropout, as the ref server), a
    micro-batch at a time, no gradient. One rank only (several ranks take the reference from the ref server)."""
    G, parts = micro_batches(batch, cfg)
    logps = []
    engine.eval()  # grpo_update puts it back in training mode
    with engine.module.disable_adapter(), torch.no_grad():
        for q0, q1 in parts:
            logps.append(sequence_logps(engine, batch["prompt_ids"][q0:q1].to(engine.device),
                                        batch["prompt_mask"][q0:q1].to(engine.device),
                                        batch["completion_ids"][q0 * G:q1 * G].to(engine.device), cfg.temperature,
                                        impl=cfg.loss_impl).float().cpu())
    return torch.cat(logps)


def grpo_update(engine, batch, cfg):
    """The GRPO update on one collated batch: the stats, and the last iteration's per-token log-probs (Q*G, C).
    pi_old, the ratio's base, is the trainer's own log-probs of the first iteration; vLLM's batch["sampler_logps"]
    weight each token (--tis_cap), or with --tis_cap 0 are pi_old. From the second of --num_iterations on, the
    ratio moves off 1 and the clip bounds the update."""
    engine.train()  # checkpointing and dropout act only in training mode
    batch = {k: v.to(engine.device) for k, v in batch.items()}
    loss_mask = batch["loss_mask"]  # (Q*G, C)
    G, parts = micro_batches(batch, cfg)
    # every rank runs as many passes as the rank with the most parts (ZeRO-2/3 communicate in each pass: ranks with
    # different numbers wait for each other forever); one with fewer reruns its first part with a gradient of 0
    passes = int(max_over_ranks(len(parts)))
    # every pass divides its loss by the whole batch's count, over every rank (grpo_math.loss_denominator), times
    # the world size: DeepSpeed averages the ranks' gradients, and that average is then the batch's gradient
    world = engine.dp_world_size
    denominator, tokens = sum_over_ranks(loss_denominator(loss_mask, cfg.loss_type, cfg.max_new_tokens),
                                         loss_mask.sum())
    # clamped once summed: a rank that keeps no token (masking) adds 0 to the count, not 1
    denominator, tokens = max(denominator, 1.0) / world, max(tokens, 1.0)  # tokens: the stats' weights
    sampler_logps = batch.get("sampler_logps")  # (Q*G, C) vLLM's; None where the trainer's own policy sampled
    tis_cap = cfg.tis_cap if sampler_logps is not None else 0.0
    sampler_is_pi_old = sampler_logps is not None and tis_cap == 0
    old_logps, skipped, norm = None, 0, None  # old_logps (Q*G, C): the trainer's own, set by the first iteration
    for _ in range(cfg.num_iterations):
        loss, stats, new_logps, entropy = 0.0, {}, [], 0.0
        for i, (q0, q1) in enumerate(parts + [parts[0]] * (passes - len(parts))):
            rows = slice(q0 * G, q1 * G)
            logps, part_entropy = sequence_logps(engine, batch["prompt_ids"][q0:q1], batch["prompt_mask"][q0:q1],
                                                 batch["completion_ids"][rows], cfg.temperature, impl=cfg.loss_impl,
                                                 entropy=True)  # (b, C) each, b = (q1 - q0) * G
            engine.set_gradient_accumulation_boundary(i == passes - 1)  # one optimizer step after the last pass
            if i >= len(parts):  # a pass that only keeps this rank in step with the others
                engine.backward(logps.sum() * 0.0)
                continue
            new_logps.append(logps.detach())
            ref = batch["ref_logps"][rows] if "ref_logps" in batch else None  # (b, C); None with beta 0
            if sampler_is_pi_old:
                pi_old, is_logps = sampler_logps[rows], None
            else:  # the trainer's own (this forward's at the first iteration); vLLM's, if any, weight the tokens
                pi_old = logps.detach() if old_logps is None else old_logps[rows]
                is_logps = None if sampler_logps is None else sampler_logps[rows]
            part_loss, part_stats = grpo_loss(logps, pi_old, ref, batch["advantages"][rows], loss_mask[rows],
                                              sampler_logps=is_logps, tis_cap=tis_cap, denominator=denominator,
                                              **loss_options(cfg))
            engine.backward(part_loss)  # the passes' gradients add up until engine.step()
            loss += part_loss.item() / world  # the ranks' sum of these is the batch's loss
            add_part_stats(stats, part_stats, loss_mask[rows].sum().item() / tokens)  # token means, by tokens
            entropy += (part_entropy * loss_mask[rows]).sum().item()
        old_logps = torch.cat(new_logps) if old_logps is None else old_logps  # (Q*G, C)
        norm, stepped = optimizer_step(engine, loss)
        skipped += not stepped
    # this rank's shares of the batch's loss and token means, and its counts; stats_over_ranks adds them up
    stats.update(loss=loss, entropy=entropy / tokens, tokens=int(loss_mask.sum()))
    if sampler_logps is not None:  # where vLLM and pi_old disagree (policy lag included), over the kept tokens
        gaps = sampler_gap_details(batch["completion_ids"], loss_mask, old_logps, sampler_logps)
        gaps["sampler_gap_mean"] *= loss_mask.sum().item() / tokens  # this rank's share of the token mean
        stats.update(gaps)
    stats = stats_over_ranks(stats)  # the whole batch's, the same on every rank
    stats.update(step_stats(engine, norm, skipped, cfg.num_iterations))
    return stats, torch.cat(new_logps)
