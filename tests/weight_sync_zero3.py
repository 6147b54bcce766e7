"""The full trainer's weight sync under ZeRO-3 on 2 ranks (run by tests/test_weight_sync.py):

    deepspeed --num_gpus 2 tests/weight_sync_zero3.py

For the tiny model (its lm_head tied to its embeddings), trained whole and with all-linear LoRA (B random, so the
merge matters): rank 0 sends the weights with WeightSender, gathering one module at a time, while rank 1 joins
the same gathers (WeightSender with no workers). Then every rank gathers every parameter at once, and rank 0
compares the shared buffer with merged_weights of the whole model. Rank 0 prints one JSON line per case.
"""
import json
import os
import queue
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from simple_grpo.train import Config  # noqa: E402
from simple_grpo.generation.weight_sync import WeightSender, tensors_in  # noqa: E402
from simple_grpo.generation.weight_sync import merged_weights  # noqa: E402
from simple_grpo.trainer.config import check_options  # noqa: E402
from simple_grpo.trainer.deepspeed_engine import make_engine  # noqa: E402

CASES = {"full": {}, "lora": {"use_peft": True, "lora_target_modules": "all-linear"}}


def run_case(name):
    import deepspeed
    cfg = Config(zero_stage=3, threads=1, lr=1e-4, **CASES[name])
    check_options(cfg)
    engine, _ = make_engine(cfg)
    module, rank = engine.module, engine.global_rank
    adapters_b = [p for key, p in module.named_parameters() if ".lora_B." in key]
    with deepspeed.zero.GatheredParameters(adapters_b, modifier_rank=0):  # rank 0's values go to every rank
        for p in adapters_b:
            torch.nn.init.normal_(p, std=0.05)
    shards = [tuple(p.shape) for p in module.parameters()]
    queues = [queue.SimpleQueue()] if rank == 0 else []
    sender = WeightSender(queues, [types.SimpleNamespace(value=0)] if rank == 0 else [])
    sender.send(engine.module, 1, 3, lambda: None, 60)
    with deepspeed.zero.GatheredParameters(list(module.parameters())), torch.no_grad():
        if rank == 0:
            expected = dict(merged_weights(module))  # the whole model's, every parameter gathered
            got = tensors_in(sender.buffers[0], sender.layout)
            bases = {key.removeprefix("base_model.model.").replace(".base_layer.", "."): p
                     for key, p in module.named_parameters() if ".lora_" not in key}
            print(json.dumps({
                "case": name, "names": list(got) == list(expected), "weights": len(got),
                "differ": [key for key in expected if not torch.equal(got[key], expected[key])],
                "merged": sum(not torch.equal(got[key], bases[key]) for key in bases),  # adapted weights, changed
                "tied": sender.layout["lm_head.weight"][0] == sender.layout["model.embed_tokens.weight"][0],
                "embed_shape": list(got["model.embed_tokens.weight"].shape),
                "shards": sum(shape == (0,) for shape in shards), "parameters": len(shards)}), flush=True)


if __name__ == "__main__":
    for name in CASES:
        run_case(name)
