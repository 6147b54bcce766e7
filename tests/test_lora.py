"""LoRA (--use_peft) with the real PEFT, DeepSpeed, ref server and vLLM: the adapters train and the base
stays bitwise as loaded; the base with the adapters off gives the ref server's log-probs; vLLM after a
sync is base + adapters; resume continues from the checkpoint's adapters; two ZeRO-2 ranks train; evaluate.py runs on
a LoRA checkpoint. The runs are the full trainer's (grpo_train.py has no LoRA)."""
import json
import os
import subprocess
import sys

import pytest

from simple_grpo.run.checkpoints import runs_root
from tools.launch import ROOT
from tests.test_ref_server import server  # noqa: F401 - the live server fixture

# one process, as a trainer runs: the engine with adapters, two GRPO updates on real rollouts with the
# reference from the adapters-off base, then the same groups through the ref server (which holds the base)
UPDATE_SCRIPT = r"""
import json, sys, torch
from grpo_math import completion_mask, kl_estimate
from simple_grpo.logprobs import sequence_logps
from simple_grpo.train import Config
from simple_grpo.generation.hf_sampler import generate
from simple_grpo.protocol import post_groups, take_group
from simple_grpo.rollouts import collate, make_groups, score_groups
from simple_grpo.task.problems import load_data, make_prompt, stop_token_ids
from simple_grpo.task.rewards import parse_reward_spec
from simple_grpo.trainer.config import check_options
from simple_grpo.trainer.deepspeed_engine import make_engine
from simple_grpo.trainer.update import grpo_update, reference_logps

cfg = Config(use_peft=True, lora_dropout=0.0, lora_target_modules="all-linear", lr=2e-3, beta=0.04,
             batch_prompts=4, ref_url=sys.argv[1], threads=2)
check_options(cfg)
weights, problems = parse_reward_spec(cfg.reward_funcs, cfg.reward_weights), load_data(cfg)
engine, tok = make_engine(cfg)
stop_ids = stop_token_ids(tok, cfg.prompt_format)
base = {k: v.clone() for k, v in engine.module.state_dict().items() if ".lora_" not in k}
trainable = [k for k, p in engine.module.named_parameters() if p.requires_grad]

batch_problems = problems[:cfg.batch_prompts]
prompts = [make_prompt(tok, p["question"], cfg.prompt_format) for p in batch_problems]
prompt_ids, prompt_mask, completion_ids = generate(engine.module, tok, prompts, cfg, stop_ids)
mask = completion_mask(completion_ids, stop_ids)
texts = tok.batch_decode(completion_ids * mask.long() + tok.pad_token_id * (1 - mask.long()), skip_special_tokens=True)
rewards, scores = score_groups(texts, batch_problems, cfg.num_generations, weights)
rows = [ids[m.bool()] for ids, m in zip(prompt_ids, prompt_mask)]
groups, _ = make_groups(rows, completion_ids, mask, rewards, cfg.num_generations,
                        {"run_id": "lora-test", "policy_version": 0, "temperature": cfg.temperature}, keep_equal=True)
batch = collate([t for t, _ in groups], tok.pad_token_id)
batch["loss_mask"] = completion_mask(batch["completion_ids"], stop_ids)
kls = []
for _ in range(3):
    batch["ref_logps"] = reference_logps(engine, batch, cfg)
    stats, _ = grpo_update(engine, batch, cfg)
    kls.append(stats["kl"])

# the reference, two ways: the adapters-off base here, the ref server's model there
local = reference_logps(engine, batch, cfg)
post_groups(cfg, groups)
served = collate([take_group(cfg, "lora-test", 60)[0] for _ in groups], tok.pad_token_id)["ref_logps"]
with torch.no_grad():
    policy = sequence_logps(engine, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], cfg.temperature)
m = batch["loss_mask"].float()
kl = lambda ref: ((kl_estimate(policy, ref) * m).sum() / m.sum()).item()
print(json.dumps({
    "trainable": trainable,
    "lora_B_max": max(p.abs().max().item() for k, p in engine.module.named_parameters() if "lora_B" in k),
    "base_changed": [k for k, v in engine.module.state_dict().items() if ".lora_" not in k and not torch.equal(v, base[k])],
    "ref_max_diff": ((local - served).abs() * m).max().item(),
    "policy_vs_ref": ((policy - local).abs() * m).max().item(),
    "kl_local": kl(local), "kl_served": kl(served), "kls": kls,
}))
"""


def test_adapters_train_the_base_stays_bitwise_and_the_adapters_off_reference_is_the_ref_servers(server):  # noqa: F811
    out = subprocess.run([sys.executable, "-c", UPDATE_SCRIPT, server], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["trainable"] and all(".lora_A." in k or ".lora_B." in k for k in r["trainable"]), r["trainable"]
    assert r["lora_B_max"] > 0  # B starts at zero: the adapters trained
    assert r["base_changed"] == []  # every base weight bitwise as loaded
    assert r["policy_vs_ref"] > 1e-3  # the policy moved off the base, so the check below is not trivial
    assert r["ref_max_diff"] <= 1e-5, r
    assert abs(r["kl_local"] - r["kl_served"]) <= 1e-5 and r["kl_local"] > 0, r
    print(f"LoRA reference vs ref server: max |diff| {r['ref_max_diff']:.2e}, KL {r['kl_local']:.5f} vs "
          f"{r['kl_served']:.5f}; KL over the updates {r['kls']}")


def metrics(run):
    with open(os.path.join(runs_root(), run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


LORA_TRAIN = [sys.executable, "-m", "simple_grpo.train", "--use_peft", "--lora_target_modules", "all-linear", "--lr",
              "1e-3", "--batch_prompts", "4", "--save_every", "2", "--seed", "5", "--overwrite"]  # the full trainer's


def test_a_lora_checkpoint_holds_the_adapters_and_evaluate_runs_on_it():
    out = subprocess.run(LORA_TRAIN + ["--steps", "2", "--run_name", "test_lora_ckpt"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    step = os.path.join(runs_root(), "test_lora_ckpt", "step_2")
    files = os.listdir(step)
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files and "config.json" not in files
    assert os.path.getsize(os.path.join(step, "adapter_model.safetensors")) < os.path.getsize(
        os.path.join(ROOT, "models", "tiny-math", "model.safetensors"))
    # the transformers backend: evaluate.py merges the adapters before it picks a backend (and no vLLM start)
    ev = subprocess.run([sys.executable, "evaluate.py", "--model", step, "--n", "20", "--json", "--backend", "hf"],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert "holds LoRA adapters" in ev.stdout and json.loads(ev.stdout.strip().splitlines()[-1])["n"] == 20
    merged = subprocess.run([sys.executable, "tools/merge_lora.py", step], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert merged.returncode == 0, merged.stderr[-3000:]
    assert os.path.exists(os.path.join(step, "merged", "model.safetensors"))


@pytest.mark.slow
def test_lora_resume_continues_the_same_run_step_for_step():
    """4 steps at once, and 2 + 2 with --resume (dropout on): the same rewards, losses and KLs at the steps before
    the checkpoint; the steps after it train from the checkpoint's adapters (policy lag 0) on vLLM's new samples
    (its sampler starts afresh with the new process, so they are not the uninterrupted run's draws)."""
    common = LORA_TRAIN + ["--lora_dropout", "0.05"]
    for args in (["--steps", "4", "--run_name", "test_lora_whole"], ["--steps", "2", "--run_name", "test_lora_parts"]):
        out = subprocess.run(common + args, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
    out = subprocess.run([a for a in common if a != "--overwrite"] + ["--steps", "4", "--run_name", "test_lora_parts",
                                                                      "--resume"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming after step 2" in out.stdout
    whole, parts = metrics("test_lora_whole"), metrics("test_lora_parts")
    assert [r["step"] for r in parts] == [1, 2, 3, 4]
    for got, want in zip(parts[:2], whole):
        for key in ("reward_mean", "accuracy", "completion_len", "loss", "kl", "grad_norm"):
            assert got[key] == want[key], (key, got, want)
    assert parts[2]["policy_lag"] == 0 and whole[-1]["kl"] > 0 and parts[-1]["kl"] > 0


@pytest.mark.slow
def test_two_ranks_train_lora_adapters_under_zero_2(server):  # noqa: F811
    """The full trainer (grpo_train.py runs one process); several ranks take their batches from a ref server."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
                          "simple_grpo.train", "--use_peft", "--ref_url", server, "--zero_stage", "2", "--steps", "2",
                          "--batch_prompts", "2", "--threads", "1", "--run_name", "test_lora_two_ranks", "--overwrite"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics("test_lora_two_ranks")
    assert [r["step"] for r in rows] == [1, 2]
    assert os.path.exists(os.path.join(runs_root(), "test_lora_two_ranks", "step_2", "adapter_model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("options", [["--zero_stage", "1", "--dtype", "bfloat16"],
                                     ["--zero_stage", "2", "--gradient_checkpointing"],
                                     ["--zero_stage", "3", "--dtype", "bfloat16", "--gradient_checkpointing"]],
                         ids=["zero1-bf16", "zero2-checkpointing", "zero3-bf16-checkpointing"])
def test_lora_trains_under_each_zero_stage_with_bf16_and_checkpointing(options):
    run = "test_lora_" + "_".join(o.strip("-") for o in options)
    out = subprocess.run(LORA_TRAIN + ["--steps", "2", "--run_name", run, *options], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["kl"] > 0 and rows[-1]["grad_norm"] > 0
    assert os.path.exists(os.path.join(runs_root(), run, "step_2", "adapter_model.safetensors"))
