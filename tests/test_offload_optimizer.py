"""--offload_optimizer: the host-side AdamW (torch's fused one) takes the same steps as the one on the device,
and runs on --offload_threads threads while the rest of the trainer keeps its --threads. Real DeepSpeed
engines (ZeRO-2, one CPU rank) on the tiny model."""
import torch

from grpo_train import Config
from simple_grpo.trainer.config import check_options
from simple_grpo.trainer.deepspeed_engine import make_engine


def two_steps(**options):
    """The engine's weights after two steps on one fixed sentence, the threads its optimizer step ran on, and
    the threads torch has outside the step."""
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


def test_the_offloaded_fused_adamw_on_two_threads_takes_the_same_steps():
    on_device, device_threads, _ = two_steps()
    offloaded, offload_threads, after = two_steps(offload_optimizer=True, offload_threads=2)
    assert device_threads == [1, 1] and offload_threads == [2, 2] and after == 1
    worst = max((offloaded[name] - w).abs().max().item() for name, w in on_device.items())
    moved = max((w - offloaded[name]).abs().max().item() for name, w in two_steps(lr=0.0)[0].items())
    assert worst < 5e-3 * moved  # the steps moved the weights, and both optimizers moved them alike (fused and
    # for-loop AdamW round differently: ~1e-6 here, ~1e-3 of a step)
