"""models/tiny-math: loads with transformers and vLLM; tokenizer and chat template behave."""
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from simple_grpo.task.problems import SYSTEM_PROMPT, make_prompt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "tiny-math")
QUESTION = "Mia has 12 apples. She buys 7 more apples. How many apples does Mia have now?"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL)


def test_model_is_qwen2_and_small_enough_to_commit():
    assert AutoConfig.from_pretrained(MODEL).model_type == "qwen2"
    size = sum(os.path.getsize(os.path.join(MODEL, f)) for f in os.listdir(MODEL))
    assert size <= 20 * 2**20


def test_eos_and_pad_are_distinct_tokens(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id != tokenizer.pad_token_id


def test_tags_and_digits_are_single_tokens(tokenizer):
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1, tag
    ids = tokenizer("12+347=359", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == list("12+347=359")


def test_chat_template_round_trip(tokenizer):
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "<think>12+7=19</think><answer>19</answer>"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
                    "<|im_start|>assistant\n<think>12+7=19</think><answer>19</answer><|im_end|>\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text  # encode then decode gives the text back
    prompt = make_prompt(tokenizer, QUESTION)
    assert prompt.endswith("<|im_start|>assistant\n") and text.startswith(prompt)


def test_transformers_loads_and_generates_in_format(tokenizer):
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    enc = tokenizer(make_prompt(tokenizer, QUESTION), return_tensors="pt", add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=40, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    completion = out[0, enc["input_ids"].shape[1]:].tolist()
    assert completion[-1] == tokenizer.eos_token_id  # it stops by itself
    assert tokenizer.decode(completion, skip_special_tokens=True).startswith("<think>")


def test_vllm_loads_on_cpu_and_its_logprobs_match_transformers(tokenizer):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    llm = LLM(model=MODEL, dtype="float32", enforce_eager=True, seed=0, max_model_len=512)
    prompt = make_prompt(tokenizer, QUESTION)
    out = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=40, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > 0 and out.text
    vllm_logps = torch.tensor([lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)])
    # the same tokens scored by a transformers forward pass
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + list(out.token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1]
    hf_logps = logits.log_softmax(-1).gather(-1, ids[0, len(prompt_ids):, None])[:, 0]
    assert torch.allclose(vllm_logps, hf_logps, atol=1e-4)
