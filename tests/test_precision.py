"""Precision and memory options: truncated importance sampling of vLLM's log-probs, the log-prob
pass under gradient checkpointing, and the DeepSpeed config the flags (or a --deepspeed file) make."""
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from simple_grpo.trainer.deepspeed_engine import deepspeed_config
from grpo_math import capped_is_weight, grpo_loss
from simple_grpo.logprobs import sequence_logps
from simple_grpo.train import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "models", "tiny-math")


def random_batch(B=4, C=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(B, C, generator=g) * 3).requires_grad_()
    return logps, -torch.rand(B, C, generator=g) * 3, torch.randn(B, generator=g), torch.ones(B, C)


def test_tis_weight_is_the_trainer_to_sampler_ratio_capped_and_detached():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-1.0, -1.5, -4.0]])  # equal, a little lower, far lower
    w = capped_is_weight(old, sampler, cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, float(torch.exp(torch.tensor(0.5))), 2.0]]))
    assert not w.requires_grad


def test_tis_weights_each_tokens_policy_term_and_leaves_the_kl_alone():
    logps, ref, A, mask = random_batch()
    sampler = logps.detach() + 0.3 * torch.randn_like(logps)  # another engine's numbers
    loss, stats = grpo_loss(logps, logps.detach(), ref, A, mask, beta=0.04, sampler_logps=sampler, tis_cap=2.0)
    w = torch.exp(logps.detach() - sampler).clamp(max=2.0)
    kl = torch.exp(ref - logps) - (ref - logps) - 1
    by_hand = ((w * -(torch.exp(logps - logps.detach()) * A[:, None]) + 0.04 * kl).mean(1)).mean()
    assert torch.allclose(loss, by_hand, atol=1e-6)
    assert stats["is_weight_mean"] == pytest.approx(w.mean().item(), abs=1e-6)
    assert stats["is_weight_max"] == pytest.approx(w.max().item(), abs=1e-6)


def test_a_sampler_mismatch_masks_tokens_through_the_clip_without_tis_but_not_with_it():
    logps, ref, A, mask = random_batch(seed=1)
    sampler = logps.detach() - 0.5  # bf16 sampler 0.5 nats off on every token: ratio e^0.5 = 1.65
    _, plain = grpo_loss(logps, sampler, ref, A, mask)  # vLLM's numbers as the old policy's
    _, tis = grpo_loss(logps, logps.detach(), ref, A, mask, sampler_logps=sampler, tis_cap=2.0)
    assert plain["clip_fraction"] > 0.3  # tokens with A > 0 get no gradient at all
    assert tis["clip_fraction"] == 0.0 and tis["is_weight_mean"] == pytest.approx(1.6487, abs=1e-3)


def test_with_equal_numbers_tis_changes_nothing():
    logps, ref, A, mask = random_batch(seed=2)
    plain, _ = grpo_loss(logps, logps.detach(), ref, A, mask)
    tis, _ = grpo_loss(logps, logps.detach(), ref, A, mask, sampler_logps=logps.detach(), tis_cap=2.0)
    assert torch.allclose(plain, tis)


def test_log_probs_under_gradient_checkpointing_equal_the_shared_prompt_pass_with_gradients():
    torch.manual_seed(0)
    prompt_ids, completion_ids = torch.randint(3, 500, (2, 7)), torch.randint(3, 500, (6, 5))
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :2] = 0  # left padding
    results = []
    for checkpointing in (False, True):
        model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        logps = sequence_logps(model, prompt_ids, prompt_mask, completion_ids, temperature=0.7)
        logps.sum().backward()
        results.append((logps.detach(), model.model.embed_tokens.weight.grad.clone()))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-5)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-5)


def test_flags_make_a_bf16_zero2_offload_config():
    ds, notes = deepspeed_config(Config(dtype="bfloat16", zero_stage=2, offload_optimizer=True, lr=3e-6))
    assert ds["bf16"] == {"enabled": True} and ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["optimizer"]["params"]["lr"] == 3e-6 and notes == []


def test_a_deepspeed_file_wins_takes_auto_from_the_flags_and_names_a_conflict(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                                "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    cfg = Config(deepspeed=str(path), zero_stage=2, lr=5e-6)
    ds, notes = deepspeed_config(cfg, Config())
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"]["enabled"] is True
    assert ds["optimizer"]["params"]["lr"] == 5e-6  # "auto": the flag's
    assert notes == [f"--deepspeed {path}: zero_optimization.stage = 3 from the file, not 2 from the flags"]
    _, quiet = deepspeed_config(Config(deepspeed=str(path)), Config())  # flags at their defaults: nothing to name
    assert quiet == []


def test_a_deepspeed_file_with_gradient_accumulation_is_refused(tmp_path):
    """engine.step() would take the optimizer step only every 2nd call: the update loop expects one each."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": 2}))
    with pytest.raises(SystemExit, match="gradient_accumulation_steps 2: the trainers call engine.step"):
        deepspeed_config(Config(deepspeed=str(path)), Config())


def test_a_deepspeed_file_changing_the_optimizer_clipping_or_schedule_is_named(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"params": {"weight_decay": 0.1}}, "gradient_clipping": 0.5,
                                "scheduler": {"type": "WarmupLR"}}))
    _, notes = deepspeed_config(Config(deepspeed=str(path)), Config())
    where = "(trainer/deepspeed_engine.py's flag_config)"
    assert notes == [f"--deepspeed {path}: optimizer.params.weight_decay = 0.1 from the file, where the trainers set "
                     f"0.0 {where}",
                     f"--deepspeed {path}: gradient_clipping = 0.5 from the file, where the trainers set 1.0 {where}",
                     f"--deepspeed {path}: scheduler = {{'type': 'WarmupLR'}} from the file, where the trainers set "
                     f"none {where}"]


def test_bad_precision_and_deepspeed_options_are_named(tmp_path):
    with pytest.raises(SystemExit, match="unknown --dtype 'fp8'"):
        deepspeed_config(Config(dtype="fp8"))
    with pytest.raises(SystemExit, match="--offload_optimizer needs ZeRO"):
        deepspeed_config(Config(offload_optimizer=True))
    with pytest.raises(SystemExit, match="no such file"):
        deepspeed_config(Config(deepspeed=str(tmp_path / "none.json")))
    (tmp_path / "bad.json").write_text("{stage: 2")
    with pytest.raises(SystemExit, match="not valid JSON"):
        deepspeed_config(Config(deepspeed=str(tmp_path / "bad.json")))
