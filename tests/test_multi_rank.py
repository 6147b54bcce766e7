"""Several DeepSpeed ranks on CPU (gloo): 2 ranks with ZeRO-2 and ZeRO-3, launched by torchrun and
by the deepspeed launcher, take the same steps as one rank on the same global batch."""
import contextlib
import json
import os
import subprocess
import sys

import pytest

from simple_grpo.run.checkpoints import runs_root
from tools.launch import free_port, start_ref_server, stop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)

# Every rank builds the same global batch (4 groups of 4) and trains 3 steps on its share of the groups;
# DeepSpeed averages the ranks' gradients, so the step is the global batch's. Rank 0 prints the
# loss averaged over ranks and a checksum of the weights after the step.
STEP = r"""
import json, os, sys
import torch
import torch.distributed as dist
sys.path.insert(0, os.getcwd())
from simple_grpo.trainer.deepspeed_engine import make_engine
from simple_grpo.train import Config
from simple_grpo.trainer.config import check_options
from simple_grpo.trainer.update import grpo_update
from simple_grpo.logprobs import sequence_logps
from grpo_math import completion_mask
from simple_grpo.run.checkpoints import save_checkpoint

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
cfg = Config(zero_stage=int(args[0]), threads=1, lr=1e-4)
check_options(cfg)
engine, tok = make_engine(cfg)
rank, world = engine.global_rank, engine.world_size
g = torch.Generator().manual_seed(0)
Q, G = 4, 4
batch = {"prompt_ids": torch.randint(3, 500, (Q, 7), generator=g), "prompt_mask": torch.ones(Q, 7, dtype=torch.long),
         "completion_ids": torch.randint(3, 500, (Q * G, 5), generator=g), "advantages": torch.randn(Q * G, generator=g)}
batch["completion_ids"][::3, 2] = tok.eos_token_id
batch["loss_mask"] = completion_mask(batch["completion_ids"], tok.eos_token_id)
with torch.no_grad():  # reference log-probs near the policy's (every rank computes them for the whole batch)
    batch["ref_logps"] = sequence_logps(engine, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                        cfg.temperature) + 0.1 * torch.randn(Q * G, 5, generator=g)
q = Q // world  # this rank's groups
mine = {k: (v[rank * q:(rank + 1) * q] if k.startswith("prompt") else v[rank * q * G:(rank + 1) * q * G])
        for k, v in batch.items()}
losses, skipped = [], 0
for step in range(3):  # three steps on this batch
    stats, _ = grpo_update(engine, mine, cfg)
    losses.append(stats["loss"])
    skipped += stats["skipped_updates"]
loss = torch.tensor(losses)
if dist.is_initialized() and world > 1:
    dist.all_reduce(loss)
    loss /= world
out_dir = args[1]
save_checkpoint(engine, tok, out_dir, 1, {})  # gathers ZeRO-3's shards for the HF model
if rank == 0:
    from safetensors.torch import load_file
    saved = load_file(os.path.join(out_dir, "step_1", "model.safetensors"))
    print(json.dumps({"loss": loss.tolist(), "world": world, "skipped": skipped,
                      "weights_sum": sum(t.double().sum().item() for t in saved.values()),
                      "numel": sum(t.numel() for t in saved.values())}))
"""


def run_step(tmp_path, launcher, stage):
    script = tmp_path / "step.py"
    script.write_text(STEP)
    out_dir = tmp_path / f"{launcher}_{stage}"
    if launcher == "python":
        cmd = [sys.executable, str(script), str(stage), str(out_dir)]
    elif launcher == "torchrun":
        cmd = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), str(script),
               str(stage), str(out_dir)]
    else:
        cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(script),
               str(stage), str(out_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith('{"loss"')]
    assert len(lines) == 1, out.stdout[-3000:]  # rank 0 alone prints
    return json.loads(lines[0])


@pytest.mark.slow
@pytest.mark.parametrize("launcher, stage", [("torchrun", 2), ("deepspeed", 3)])
def test_two_ranks_take_the_one_rank_step(tmp_path, launcher, stage):
    one = run_step(tmp_path, "python", stage)
    two = run_step(tmp_path, launcher, stage)
    assert one["world"] == 1 and two["world"] == 2 and one["skipped"] == two["skipped"] == 0
    print(f"1 rank: {one}\n2 ranks ({launcher}, ZeRO-{stage}): {two}")
    assert two["loss"][0] == pytest.approx(one["loss"][0], abs=1e-5)  # step 1: the same weights, the same batch
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-4)  # steps 2-3 too, up to Adam's rounding
    # the saved model is whole under ZeRO-3 (gathered), and the step moved it the same way
    assert two["numel"] == one["numel"] > 1_000_000
    assert two["weights_sum"] == pytest.approx(one["weights_sum"], rel=1e-4)


# Two ranks whose batches hold different numbers of groups, as when the reward leaves one rank's batch
# fewer groups with signal (the others are dropped before the trainer sees them): rank 0 trains on 3
# groups, rank 1 on 1, with --micro_batch_groups N (argv[2]). Prints the rank-averaged losses and the
# saved weights' sum, as STEP does.
UNEVEN = STEP.replace("cfg = Config(zero_stage=int(args[0]), threads=1, lr=1e-4)",
                      "cfg = Config(zero_stage=int(args[0]), threads=1, lr=1e-4, micro_batch_groups=int(args[2]))")
UNEVEN = UNEVEN.replace("""q = Q // world  # this rank's groups
mine = {k: (v[rank * q:(rank + 1) * q] if k.startswith("prompt") else v[rank * q * G:(rank + 1) * q * G])
        for k, v in batch.items()}""", """first, end = [(0, 3), (3, 4)][rank]  # this rank's groups
mine = {k: (v[first:end] if k.startswith("prompt") else v[first * G:end * G]) for k, v in batch.items()}""")
assert UNEVEN.count("micro_batch_groups") == 1 and "first, end" in UNEVEN


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_ranks_with_different_numbers_of_groups_take_micro_batched_steps_together(tmp_path, stage):
    """With --micro_batch_groups 1 rank 0 runs 3 forward/backward passes and rank 1 one; ZeRO-2 reduces and
    ZeRO-3 gathers in every pass, so before the ranks were evened out (grpo_update's `passes`) this waited
    until the deadline. Now it finishes, and with the same losses and weights as one pass per rank."""
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN)
    results = {}
    for groups in (1, 0):
        cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(script),
               str(stage), str(tmp_path / f"out_{groups}"), str(groups)]
        out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        lines = [line for line in out.stdout.splitlines() if line.startswith('{"loss"')]
        assert len(lines) == 1, out.stdout[-3000:]
        results[groups] = json.loads(lines[0])
    micro, whole = results[1], results[0]
    print(f"ZeRO-{stage}, 3 + 1 groups: micro-batched {micro}, whole {whole}")
    assert micro["world"] == 2 and micro["skipped"] == whole["skipped"] == 0
    assert micro["loss"] == pytest.approx(whole["loss"], abs=1e-5)
    assert micro["weights_sum"] == pytest.approx(whole["weights_sum"], rel=1e-6)


def test_the_ref_server_hands_each_run_its_own_groups_and_drops_stale_ones():
    """ref_server.py's app with --max_queue 3 and a stale time of 2 s, live on loopback in this process (the tiny
    model on the CPU): /get?run_id= takes that run's oldest group, /get alone any run's oldest; when 3 finished
    groups wait, an upload gets 503 until the oldest has waited 2 s (its run stopped taking), then it is dropped
    to make room."""
    import threading
    import time
    import requests
    import torch
    from transformers import AutoModelForCausalLM
    import ref_server
    from simple_grpo.protocol import decode, encode
    from tests.test_ref_server_hostile import valid_group
    model_path = os.path.join(ROOT, "models", "tiny-math")
    cfg = ref_server.Config(model=model_path, port=free_port(), max_queue=3, device="cpu", dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval().requires_grad_(False)
    server = ref_server.Server(cfg)
    server.set_app(ref_server.make_app(model, cfg, stale_s=2.0))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{cfg.port}"

    def put(run_id, version):
        tensors, meta = valid_group(version)
        return requests.post(url + "/upload", data=encode(tensors, {**meta, "run_id": run_id}), timeout=30).status_code

    def get(run_id=None, wait=10):  # (run_id, policy_version) of the group taken, else the HTTP status
        r = requests.get(url + "/get", params={"run_id": run_id, "wait": wait}, timeout=30)
        if r.status_code != 200:
            return r.status_code
        meta = decode(r.content)[1]
        return meta["run_id"], meta["policy_version"]

    def ready(n):  # wait until n groups are finished
        deadline = time.time() + 30
        while requests.get(url + "/stats", timeout=5).json()["ready"] != n:
            assert time.time() < deadline, f"{n} groups were not finished within 30 s"
            time.sleep(0.02)

    try:
        assert [put("rank0", 0), put("rank1", 1), put("rank0", 2)] == [200] * 3
        ready(3)
        assert get("rank1") == ("rank1", 1)  # not rank 0's older group
        assert get("rank0") == ("rank0", 0) and get() == ("rank0", 2)
        assert get("rank1", wait=0.1) == 204
        assert [put("dead_run", v) for v in (10, 11, 12)] == [200] * 3
        ready(3)
        assert put("live", 20) == 503  # full, and no group has waited 2 s yet
        time.sleep(2.1)
        assert put("live", 20) == 200  # full: the oldest stale group made room
        ready(3)
        assert get("live") == ("live", 20) and get("dead_run") == ("dead_run", 11)  # dead_run's 10 was dropped
        stats = requests.get(url + "/stats", timeout=5).json()
        assert stats["ready"] == 1 and stats["rejected_full"] == stats["groups_stale"] == 1 and stats["errors"] == 0
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
@pytest.mark.parametrize("trainer, stage, workers, options", [("full", 3, 1, []), ("full", 2, 2, []),
                                                             ("full", 3, 1, ["--micro_batch_groups", "1"]),
                                                             ("full", 2, 1, ["--max_policy_lag", "2"]),
                                                             ("grpo_vllm_one", 2, 1, [])])
def test_two_ranks_with_a_ref_server(trainer, stage, workers, options):
    """deepspeed --num_gpus 2 (grpo_train.py runs one process: tests/test_grpo_train.py checks it says so):
    the full trainer's one vLLM worker (on rank 0; the lesson's too) makes a batch for each rank, which the
    server routes by run_id, and under ZeRO-3 both ranks gather the weights for each sync; with
    --gen_every 1 two workers (one per rank, as on two nodes) feed the one server. Every group comes
    back, rank 0 logs, the checkpoint is whole, and no process is left behind. With --micro_batch_groups 1
    the ranks' batches hold different numbers of groups (those with signal) and still step together. With
    --max_policy_lag 2 the worker samples several batches a call, and no rank's batch trains beyond the bound."""
    import psutil
    import requests
    import time
    port, run = free_port(), f"test_two_ranks_{trainer}_{workers}{'_' + options[0].strip('-') if options else ''}"
    extra = (["--gen_every", "1"] if workers == 2 else []) + options
    server = start_ref_server(port, os.environ, stdout=subprocess.DEVNULL)  # stops the test if it does not start
    launcher, family, spawned = None, [], set()  # the run's launcher; every process of the run; its workers
    try:
        launcher = subprocess.Popen(
            [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
             *(["--module", "simple_grpo.train"] if trainer == "full" else [f"{trainer}.py"]),
             "--ref_url", f"http://127.0.0.1:{port}", "--steps", "3", "--save_every", "2", "--batch_prompts", "2",
             "--num_generations", "4", "--max_new_tokens", "24", "--zero_stage", str(stage), "--threads", "1",
             "--run_name", run, *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            # as vLLM on CPU leaves it in a process that ran an engine (earlier tests here did): under the
            # deepspeed launcher it must not count, or each rank would start a worker of its own
            env=dict(os.environ, LOCAL_WORLD_SIZE="1"))
        deadline = time.time() + 900
        while launcher.poll() is None and time.time() < deadline:
            try:
                family = list({p.pid: p for p in family + psutil.Process(launcher.pid).children(recursive=True)}.values())
                spawned |= {p.pid for p in family if "spawn_main" in " ".join(p.cmdline())}
            except psutil.NoSuchProcess:
                pass
            time.sleep(1)
        assert launcher.poll() is not None, f"the run did not end in 900 s: {' '.join(launcher.args)}"
        out = launcher.communicate(timeout=60)[0]
        assert launcher.returncode == 0, out[-4000:]
        rows = [json.loads(line) for line in open(os.path.join(runs_root(), run, "metrics.jsonl"))]
        assert [r["step"] for r in rows] == [1, 2, 3]
        if "--max_policy_lag" in options:  # every rank's batch, each step: within the bound
            assert all(len(r["batch_lags"]) == 2 and max(r["batch_lags"]) <= 2 for r in rows), rows
            assert max(r["gen_call_batches"] for r in rows) == 2, rows  # a call sampled two batches
        from safetensors.torch import load_file
        saved = load_file(os.path.join(runs_root(), run, "step_3", "model.safetensors"))
        assert sum(t.numel() for t in saved.values()) > 1_000_000  # whole, not ZeRO-3 shards
        stats = requests.get(f"http://127.0.0.1:{port}/stats", timeout=5).json()
        assert stats["groups_taken"] + stats["ready"] + stats["waiting"] == stats["groups_in"], stats  # none lost
        assert stats["groups_taken"] >= 2 * 3, stats  # each rank took at least a group a step
        assert len(family) >= 2 and len(spawned) == (0 if trainer == "grpo_train" else workers), spawned
        _, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        if launcher is not None and launcher.poll() is None:  # timed out: leave none of the run's processes behind
            launcher.kill()
            for p in family:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        stop(server)


def global_batch_run(tmp_path, ranks, stage, micro, cases=()):
    """tests/global_batch_step.py on 1 rank (plain python) or 2 (the deepspeed launcher), for `cases` (none: its
    default set): {case: (its JSON, how far each weight moved)}."""
    out_dir = tmp_path / f"ranks{ranks}_zero{stage}_micro{micro}"
    script = [os.path.join(ROOT, "tests", "global_batch_step.py"), str(stage), str(micro), str(out_dir), *cases]
    cmd = ([sys.executable] if ranks == 1 else
           [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]) + script
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    import numpy as np
    return {p.stem: (json.load(open(p)), np.load(p.with_suffix(".npy"))) for p in sorted(out_dir.glob("*.json"))}


@pytest.mark.slow  # ~6 min: three launches of eight engines each
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_uneven_ranks_take_the_global_batchs_step_for_every_loss_type(tmp_path, stage):
    """One rank on all 4 groups against 2 ranks holding 3 and 1 of them (and unequal token counts), whole and
    micro-batched (one group a pass), for every loss type, GSPO, RAFT and LoRA: at each of 3 steps the same
    global gradient norm (1e-4 relative), the same logged loss and diagnostics, and the same weights after.
    Before every part divided by the whole batch's count (grpo_math.loss_denominator), a group on the
    1-group rank weighed 3x one on the other (grpo, step 1: grad norm 6.3286 on 2 ranks against 3.4404 on 1)."""
    one = global_batch_run(tmp_path, 1, stage, 0)
    for micro in (0, 1):
        two = global_batch_run(tmp_path, 2, stage, micro)
        assert set(two) == set(one) == {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "gspo", "raft", "lora"}
        same_steps(one, two, stage, micro)


def same_steps(one, two, stage, micro):
    """Each case's 3 steps on 2 ranks are its steps on 1: the gradient norm (1e-4 relative), the logged loss and
    diagnostics, the token count, and how far the weights moved."""
    import numpy as np
    for case, (figures, moved) in one.items():
        theirs, their_moved = two[case]
        print(f"ZeRO-{stage}, {case}, micro {micro}: grad norms 1 rank "
              f"{[round(s['grad_norm'], 6) for s in figures['steps']]}, 2 ranks "
              f"{[round(s['grad_norm'], 6) for s in theirs['steps']]}")
        assert figures["world"] == 1 and theirs["world"] == 2
        for mine, other in zip(figures["steps"], theirs["steps"]):
            assert mine["skipped_updates"] == other["skipped_updates"] == 0
            assert other["grad_norm"] == pytest.approx(mine["grad_norm"], rel=1e-4), case
            assert other["tokens"] == mine["tokens"], case  # the whole batch's, not rank 0's
            for key in ("loss", "kl", "clip_fraction", "ratio_mean", "entropy"):
                assert other[key] == pytest.approx(mine[key], rel=1e-4, abs=1e-6), (case, key)
        # the weights after 3 steps moved the same (Adam divides each gradient by its own size, so a weight
        # whose gradient is near 0 moves by rounding noise: the whole move is compared, not each weight)
        assert np.linalg.norm(their_moved - moved) <= 1e-4 * np.linalg.norm(moved), case


@pytest.mark.slow  # ~3 min: two launches of five engines each, a stage
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_rank_that_keeps_no_token_leaves_the_global_batchs_step_unchanged(tmp_path, stage):
    """Rank 1's one group cut off and masked (--mask_truncated_completions): that rank adds nothing to the batch's
    token count, and every loss type takes the step one rank takes on the same batch. Before the count was clamped
    after the sum over ranks, rank 1 added 1 to it (bnpo, ZeRO-2, step 1: grad norm 4.8683 on 2 ranks against
    5.1246 on 1)."""
    from tests.global_batch_step import MASKED
    one = global_batch_run(tmp_path, 1, stage, 0, MASKED)
    two = global_batch_run(tmp_path, 2, stage, 0, MASKED)
    assert set(one) == set(two) == set(MASKED)
    assert all(s["tokens"] > 0 for s in one["bnpo_rank1_masked"][0]["steps"])
    same_steps(one, two, stage, 0)
