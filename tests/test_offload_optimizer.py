"""--offload_optimizer: the host-side AdamW (torch's fused one) takes the same steps as the one on the device,
and runs on --offload_threads threads while the rest of the trainer keeps its --threads. Real DeepSpeed
engines (ZeRO-2, one CPU rank) on the tiny model, in a fresh process of their own: an in-process vLLM engine
from an earlier test makes torch.set_num_threads a no-op in the test process, and the engines here would
leave DeepSpeed's process groups to later tests."""
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def two_steps(**options):
    """The engine's weights after two steps on one fixed sentence, the threads its optimizer step ran on, and
    the threads torch has outside the step."""
    from simple_grpo.train import Config
    from simple_grpo.trainer.config import check_options
    from simple_grpo.trainer.deepspeed_engine import make_engine
    cfg = Config(**{"zero_stage": 2, "beta": 0.0, "threads": 1, "lr": 1e-3, **options})
    check_options(cfg)
    engine, tokenizer = make_engine(cfg)
    in_step = []
    engine.optimizer.optimizer.register_step_pre_hook(lambda *_: in_step.append(torch.get_num_threads()) and None)
    ids = tokenizer("Tom has 47 cards. He finds 3 more. <answer>50</answer>", return_tensors="pt").input_ids
    for _ in range(2):
        engine.backward(engine(ids, labels=ids).loss)
        engine.step()
    weights = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    return weights, in_step, torch.get_num_threads()


def measure():
    """What the test checks, as one JSON line: the threads of each run, and how far the offloaded steps are
    from the on-device ones against how far the steps moved the weights."""
    on_device, device_threads, _ = two_steps()
    offloaded, offload_threads, after = two_steps(offload_optimizer=True, offload_threads=2)
    worst = max((offloaded[name] - w).abs().max().item() for name, w in on_device.items())
    moved = max((w - offloaded[name]).abs().max().item() for name, w in two_steps(lr=0.0)[0].items())
    print(json.dumps({"device_threads": device_threads, "offload_threads": offload_threads, "after": after,
                      "worst": worst, "moved": moved}))


def test_the_offloaded_fused_adamw_on_two_threads_takes_the_same_steps():
    out = subprocess.run([sys.executable, "-c", "from tests.test_offload_optimizer import measure; measure()"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["device_threads"] == [1, 1] and r["offload_threads"] == [2, 2] and r["after"] == 1
    assert r["worst"] < 5e-3 * r["moved"]  # the steps moved the weights, and both optimizers moved them alike
    # (fused and for-loop AdamW round differently: ~1e-6 here, ~1e-3 of a step)
