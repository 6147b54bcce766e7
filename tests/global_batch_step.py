"""One global batch, trained 3 steps by grpo_update for each loss type, on 1 rank or 2 (run by
tests/test_multi_rank.py; launched by `deepspeed --num_gpus 2` or plain python).

    python tests/global_batch_step.py ZERO_STAGE MICRO_BATCH_GROUPS OUT_DIR [CASE ...]

Every rank builds the same batch: 4 groups of 4 completions whose lengths differ (EOS at a random
position in each), rewards, reference log-probs. One rank trains on all 4 groups; with 2 ranks,
rank 0 holds groups 0-2 and rank 1 group 3, as when one rank's reward left it fewer groups with
signal. For each case a fresh engine from the same weights takes 3 steps; rank 0 writes
OUT_DIR/CASE.json (each step's logged loss, gradient norm and diagnostics) and OUT_DIR/CASE.npy (how far
every weight moved, gathered whole under ZeRO-3). CASE: one of CASES (default: all of them) or MASKED.
"""
import contextlib
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo_math import completion_mask, group_advantages  # noqa: E402
from simple_grpo.train import Config  # noqa: E402
from simple_grpo.logprobs import sequence_logps  # noqa: E402
from simple_grpo.trainer.config import check_options  # noqa: E402
from simple_grpo.trainer.deepspeed_engine import make_engine  # noqa: E402
from simple_grpo.trainer.update import grpo_update  # noqa: E402

# each case's flags: the five loss types, GSPO's sequence-level ratio, RAFT's 0/1 advantages, LoRA (its adapters'
# dropout off: the masks it draws depend on how the batch is split, a difference that is not the weighting's)
CASES = {"grpo": {}, "bnpo": {"loss_type": "bnpo"}, "dr_grpo": {"loss_type": "dr_grpo"},
         "dapo": {"loss_type": "dapo", "epsilon_high": 0.28}, "cispo": {"loss_type": "cispo"},
         "gspo": {"importance_sampling_level": "sequence"}, "raft": {"advantage_estimator": "raft"},
         "lora": {"use_peft": True, "lr": 1e-3, "disable_dropout": True}}
# the token-mean losses again, with group 3 (rank 1's, with 2 ranks) cut off at C tokens and
# --mask_truncated_completions on: a rank that keeps no token at all
MASKED = {f"{name}_rank1_masked": {**CASES[name], "mask_truncated_completions": True}
          for name in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")}
Q, G, P, C = 4, 4, 7, 6
RANK_GROUPS = {1: [(0, 4)], 2: [(0, 3), (3, 4)]}  # (first, end) groups of each rank


def whole_weights(engine):
    """Every trainable weight, flattened into one float64 vector (gathered whole under ZeRO-3)."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    gather = contextlib.nullcontext()
    if engine.zero_optimization_stage() == 3:
        import deepspeed
        gather = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    with gather:
        return torch.cat([p.detach().double().flatten() for p in params])


def global_batch(engine, tok, cfg):
    """The batch every rank builds the same: completions of different lengths, rewards, reference log-probs."""
    g = torch.Generator().manual_seed(0)
    batch = {"prompt_ids": torch.randint(3, 500, (Q, P), generator=g), "prompt_mask": torch.ones(Q, P, dtype=torch.long),
             "completion_ids": torch.randint(3, 500, (Q * G, C), generator=g)}
    ends = torch.randint(0, C, (Q * G,), generator=g)  # each completion stops here: 1 to C tokens kept
    ends[: 3 * G] = torch.randint(0, 3, (3 * G,), generator=g)  # groups 0-2 short, group 3 up to C: tokens uneven
    batch["completion_ids"][torch.arange(Q * G), ends] = tok.eos_token_id
    if cfg.mask_truncated_completions:  # group 3 has no stop token: every one of its tokens is masked
        batch["completion_ids"][3 * G:] = torch.randint(3, 500, (G, C), generator=g)
    batch["loss_mask"] = completion_mask(batch["completion_ids"], tok.eos_token_id, cfg.mask_truncated_completions)
    rewards = torch.rand(Q * G, generator=g).round()  # 0/1: correct or not
    batch["advantages"] = group_advantages(rewards, G, scale_rewards=cfg.scale_rewards, eps=cfg.advantage_eps,
                                           estimator=cfg.advantage_estimator, correct=rewards).float()
    with torch.no_grad():  # near the policy's own
        batch["ref_logps"] = sequence_logps(engine, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                            cfg.temperature) + 0.1 * torch.randn(Q * G, C, generator=g)
    return batch


def run_case(name, stage, micro, out_dir):
    flags = {**CASES, **MASKED}[name]
    cfg = Config(zero_stage=stage, micro_batch_groups=micro, threads=1, max_new_tokens=C, **{"lr": 1e-4, **flags})
    check_options(cfg)
    engine, tok = make_engine(cfg)
    rank, world = engine.global_rank, engine.world_size
    batch = global_batch(engine, tok, cfg)
    first, end = RANK_GROUPS[world][rank]
    mine = {k: (v[first:end] if k.startswith("prompt") else v[first * G:end * G]) for k, v in batch.items()}
    before = whole_weights(engine)
    steps = [grpo_update(engine, mine, cfg)[0] for _ in range(3)]
    moved = (whole_weights(engine) - before).numpy()
    if rank == 0:
        keep = ("loss", "grad_norm", "kl", "clip_fraction", "ratio_mean", "entropy", "tokens", "skipped_updates")
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump({"world": world, "steps": [{k: s[k] for k in keep} for s in steps]}, f)
        np.save(os.path.join(out_dir, f"{name}.npy"), moved)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
    stage, micro, out_dir, names = int(args[0]), int(args[1]), args[2], args[3:] or list(CASES)
    os.makedirs(out_dir, exist_ok=True)
    for name in names:
        run_case(name, stage, micro, out_dir)
