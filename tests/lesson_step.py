"""One update on a fixed batch by the lesson (grpo_vllm_one.grpo_step) and by the full trainer (simple_grpo's
grpo_update), each on a fresh engine from the same weights, on 1 rank or 2 (run by tests/test_lesson.py).

    python tests/lesson_step.py ZERO_STAGE OUT_DIR        # or under `deepspeed --num_gpus 2`

Every rank builds the same batch: 4 groups of 4 completions of different lengths (a stop token at a random place
in each, vLLM's NO_LOGP padding after it), rewards, reference log-probs near the policy's, and sampler log-probs
up to 1.5 below or above it, so that the TIS cap (2) binds on some tokens. One rank trains on all 4 groups; with
2 ranks, rank 0 holds groups 0-2 and rank 1 group 3. Rank 0 writes OUT_DIR/lesson.json and OUT_DIR/full.json
(the logged figures) and .npy files (how far every weight moved).
"""
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo_vllm_one as lesson  # noqa: E402
from grpo_math import completion_logps, completion_mask, group_advantages  # noqa: E402
from simple_grpo.train import Config  # noqa: E402
from simple_grpo.trainer.config import check_options  # noqa: E402
from simple_grpo.trainer.deepspeed_engine import make_engine  # noqa: E402
from simple_grpo.trainer.update import grpo_update  # noqa: E402
from tests.global_batch_step import whole_weights  # noqa: E402

Q, G, P, C = 4, 4, 7, 6
RANK_GROUPS = {1: [(0, 4)], 2: [(0, 3), (3, 4)]}  # (first, end) groups of each rank
FIGURES = ("loss", "kl", "clip_fraction", "is_weight_mean", "entropy", "grad_norm")


def fixed_batch(engine, stop_id):
    """The batch every rank builds the same, with the loss mask both trainers compute from it."""
    g = torch.Generator().manual_seed(0)
    batch = {"prompt_ids": torch.randint(3, 500, (Q, P), generator=g), "prompt_mask": torch.ones(Q, P, dtype=torch.long),
             "completion_ids": torch.randint(3, 500, (Q * G, C), generator=g)}
    batch["prompt_mask"][1, :3] = 0  # left padding: a shorter prompt
    ends = torch.randint(0, C, (Q * G,), generator=g)  # each completion stops here: 1 to C tokens
    batch["completion_ids"][torch.arange(Q * G), ends] = stop_id
    batch["advantages"] = group_advantages(torch.rand(Q * G, generator=g).round(), G).float()
    with torch.no_grad():
        logps, _ = completion_logps(engine, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], 0.7)
    batch["ref_logps"] = logps + 0.1 * torch.randn(Q * G, C, generator=g)
    sampler = logps + 3 * (torch.rand(Q * G, C, generator=g) - 0.5)  # min(pi_old / pi_vLLM, 2) binds where > 2
    after = torch.arange(C)[None, :] > ends[:, None]  # what vLLM did not generate: NO_LOGP
    batch["sampler_logps"] = sampler.masked_fill(after, lesson.NO_LOGP)
    lengths = (batch["sampler_logps"] != lesson.NO_LOGP).sum(1)
    return batch, completion_mask(batch["completion_ids"], [stop_id], lengths=lengths)


def this_ranks(batch, rank, world):
    first, end = RANK_GROUPS[world][rank]
    return {k: (v[first:end] if k.startswith("prompt") else v[first * G:end * G]) for k, v in batch.items()}


def main(stage, out_dir):
    import deepspeed
    from transformers import AutoModelForCausalLM
    full_cfg = Config(zero_stage=stage, threads=1, lr=1e-4, max_new_tokens=C)
    check_options(full_cfg)
    engine, tokenizer = make_engine(full_cfg)  # the full trainer's engine
    rank, world = engine.global_rank, engine.world_size
    lesson_cfg = lesson.Config(zero_stage=stage, threads=1, lr=1e-4)
    torch.manual_seed(lesson_cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(lesson_cfg.model, dtype=torch.float32)
    lesson_engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                             config=lesson.deepspeed_config(lesson_cfg))
    lesson_engine.train()
    batch, loss_mask = fixed_batch(engine, tokenizer.eos_token_id)
    mine, mask = this_ranks(batch, rank, world), this_ranks({"m": loss_mask}, rank, world)["m"]
    results = {}
    before = whole_weights(lesson_engine)
    stats, _ = lesson.grpo_step(lesson_engine, mine, mask, lesson_cfg)
    results["lesson"] = (stats, whole_weights(lesson_engine) - before)
    before = whole_weights(engine)
    stats, _ = grpo_update(engine, {**mine, "loss_mask": mask}, full_cfg)
    results["full"] = (stats, whole_weights(engine) - before)
    if rank == 0:
        for name, (stats, moved) in results.items():
            with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
                json.dump({"world": world, **{k: stats[k] for k in FIGURES},
                           "is_capped_frac": stats.get("is_capped_frac")}, f)
            np.save(os.path.join(out_dir, f"{name}.npy"), moved.numpy())


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
    os.makedirs(args[1], exist_ok=True)
    main(int(args[0]), args[1])
