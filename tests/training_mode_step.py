"""One real update (grpo_update, simple_grpo/train.py's) on a fixed batch, for each set of flags given, in one
process: tests/test_training_mode.py runs it. For each it prints one JSON line with the engine (ZeRO stage,
weight dtype, optimizer), the module's mode and rows at every forward, the bytes of every activation autograd
saves for backward (weights left out: they are held anyway), the calls into triton_loss's kernels, the loss
and grad norm, and how far two training-mode forwards of the same batch differ.

    TRITON_INTERPRET=1 python tests/training_mode_step.py '{"plain": [], "checkpointed": ["--gradient_checkpointing"]}'
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_loss  # noqa: E402
from grpo_math import completion_mask  # noqa: E402
from simple_grpo.train import Config  # noqa: E402
from simple_grpo.flags import parse_flags  # noqa: E402
from simple_grpo.logprobs import sequence_logps  # noqa: E402
from simple_grpo.trainer.config import check_options  # noqa: E402
from simple_grpo.trainer.deepspeed_engine import make_engine  # noqa: E402
from simple_grpo.trainer.update import grpo_update, reference_logps  # noqa: E402

triton_calls, real_triton = [0], triton_loss.selective_log_softmax_triton


def counted_triton(*args):
    triton_calls[0] += 1
    return real_triton(*args)


triton_loss.selective_log_softmax_triton = counted_triton  # log_probs_of looks it up at each call


def measure(flags):
    cfg = parse_flags(Config, "", flags + ["--threads", "1", "--lr", "1e-4", "--beta", "0.04"])
    check_options(cfg)
    engine, tok = make_engine(cfg)
    started_training = engine.module.training
    modes, rows = [], []

    def record(module, args, kwargs):
        modes.append(module.training)
        rows.append(kwargs["input_ids"].size(0))
    engine.module.register_forward_pre_hook(record, with_kwargs=True)
    g = torch.Generator().manual_seed(0)
    Q, G, P, C = 2, 4, 24, 16
    batch = {"prompt_ids": torch.randint(3, 500, (Q, P), generator=g),
             "prompt_mask": torch.ones(Q, P, dtype=torch.long),
             "completion_ids": torch.randint(3, 500, (Q * G, C), generator=g),
             "advantages": torch.randn(Q * G, generator=g)}
    batch["loss_mask"] = completion_mask(batch["completion_ids"], tok.eos_token_id)
    if cfg.use_peft:  # the reference: the base, adapters off
        batch["ref_logps"] = reference_logps(engine, batch, cfg)
    else:  # a reference near the policy, as at the start of a run
        with torch.no_grad():
            batch["ref_logps"] = sequence_logps(engine, batch["prompt_ids"], batch["prompt_mask"],
                                                batch["completion_ids"]) + 0.1 * torch.randn(Q * G, C, generator=g)
    ref_modes, modes[:], rows[:], triton_calls[0] = list(modes), [], [], 0

    weights = {p.data_ptr() for p in engine.module.parameters()}
    saved = {}

    def pack(t):
        if t.data_ptr() not in weights:  # an activation
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stats, _ = grpo_update(engine, batch, cfg)
    update_modes, update_rows, update_triton_calls = list(modes), list(rows), triton_calls[0]

    with torch.no_grad():  # two forwards of the same batch in training mode: equal unless dropout acts
        a, b = [sequence_logps(engine, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"])
                for _ in "ab"]
    parameters = list(engine.module.parameters())
    return {"zero_stage": engine.zero_optimization_stage(), "param_dtype": str(parameters[0].dtype),
            # ZeRO-3 manages every weight (ds_id) and keeps the large ones as shards, gathered for use
            "partitioned": all(hasattr(p, "ds_id") for p in parameters) and any(p.numel() == 0 for p in parameters),
            "optimizer": type(engine.optimizer).__name__, "started_training": started_training,
            "ref_modes": ref_modes, "update_modes": update_modes, "update_rows": update_rows,
            "triton_calls": update_triton_calls, "saved_bytes": sum(saved.values()), "loss": stats["loss"],
            "grad_norm": stats["grad_norm"], "repeat_gap": (a - b).abs().max().item()}


if __name__ == "__main__":
    for name, flags in json.loads(sys.argv[1]).items():
        print(json.dumps({"name": name, **measure(flags)}), flush=True)
