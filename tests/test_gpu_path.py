"""What breaks only on GPUs, made visible on a CPU: collectives on a group that refuses CPU tensors
(as NCCL does), physical --gen_device ids under the deepspeed launcher, a small /dev/shm, chat-template
turn ends, the GSM8K recipe's start-up."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoTokenizer

from simple_grpo.task.problems import make_prompt, stop_token_ids
from simple_grpo.devices import check_shared_memory, generation_gpus, visible_gpus
from simple_grpo.flags import parse_flags
from grpo_math import completion_mask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "models", "tiny-math")


def run_python(code, **env):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_a_group_that_refuses_cpu_tensors_gets_its_collective_tensor_on_its_own_device():
    # "cuda:gloo" is a real process group that, like NCCL, has no backend for CPU tensors
    out = run_python("""
        import torch, torch.distributed as dist
        from simple_grpo.devices import collective_device
        dist.init_process_group("cuda:gloo", rank=0, world_size=1)
        try:
            dist.all_reduce(torch.tensor([1.0]))  # what max_over_ranks did: it stopped every multi-GPU run
        except RuntimeError as e:
            print("refused:", e)
        print("device:", collective_device().type)
    """, MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    assert "refused: No backend type associated with device type cpu" in out
    assert "device: cuda" in out


TWO_RANKS = """
import sys
import torch.multiprocessing as mp
sys.path.insert(0, sys.argv[1])

def rank(r, port, results):
    import torch.distributed as dist
    from simple_grpo.devices import max_over_ranks
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    results[r] = max_over_ranks([3.0, 7.0][r])
    dist.destroy_process_group()

if __name__ == "__main__":
    from tools.launch import free_port
    results = mp.Manager().dict()
    mp.spawn(rank, args=(free_port(), results), nprocs=2)
    print(sorted(results.items()))
"""


def test_max_over_ranks_takes_the_largest_value_on_two_gloo_ranks(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    out = subprocess.run([sys.executable, str(script), ROOT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[(0, 7.0), (1, 7.0)]" in out.stdout


def test_gen_device_minus_one_skips_the_gpu_the_launcher_gave_the_trainer():
    # deepspeed --include localhost:2 sets CUDA_VISIBLE_DEVICES=2: the trainer's "GPU 0" is physical GPU 2
    trainer = visible_gpus([0, 1, 2], {"CUDA_VISIBLE_DEVICES": "2"})[:1]
    assert trainer == [2]
    assert generation_gpus(-1, 1, trainer, [0, 1, 2]) == ([0], False)
    assert generation_gpus(1, 1, trainer, [0, 1, 2]) == ([1], False)


def test_gen_device_picks_gpus_after_the_trainer_ranks_and_shares_a_lone_gpu():
    assert generation_gpus(-1, 2, [0, 1, 2, 3], list(range(8))) == ([4, 5], False)
    assert generation_gpus(-1, 1, [0], [0]) == ([0], True)


def test_several_workers_take_gpus_of_their_own_in_turn():
    # one training GPU, three generation GPUs: worker k takes the k-th free one (or k-th gen_tp of them)
    assert [generation_gpus(-1, 1, [0], [0, 1, 2, 3], k, 3) for k in range(3)] == [([1], False), ([2], False),
                                                                                   ([3], False)]
    assert [generation_gpus(-1, 2, [0], list(range(5)), k, 2)[0] for k in range(2)] == [[1, 2], [3, 4]]
    assert [generation_gpus(4, 2, [0], list(range(8)), k, 2)[0] for k in range(2)] == [[4, 5], [6, 7]]
    with pytest.raises(SystemExit, match=r"--gen_workers 2 --gen_tp 1 needs 2 GPUs that no trainer rank uses"):
        generation_gpus(-1, 1, [0], [0, 1], 1, 2)  # two workers cannot share the trainer's GPU


def test_gen_tp_above_1_is_refused_on_the_command_line_naming_gen_workers():
    # tensor-parallel vLLM would run in processes that the in-memory weight sync cannot reach
    from simple_grpo.train import Config
    with pytest.raises(SystemExit) as refused:
        parse_flags(Config, args=["--gen_tp", "2"])
    assert str(refused.value).startswith("--gen_tp 2: simple_grpo/train.py syncs weights only into a vLLM of one GPU "
                                         "(--gen_tp 1).")
    assert "--gen_workers K one-GPU vLLM workers" in str(refused.value)
    assert parse_flags(Config, args=["--gen_tp", "1"]).gen_tp == 1


def test_a_gen_device_that_is_not_on_the_machine_is_a_clear_error():
    with pytest.raises(SystemExit, match=r"needs GPU\(s\) \[3\], but nvidia-smi lists GPUs 0-2"):
        generation_gpus(3, 1, [2], [0, 1, 2])
    with pytest.raises(SystemExit, match="name GPUs by number"):
        visible_gpus([0, 1], {"CUDA_VISIBLE_DEVICES": "GPU-8f6c"})


def test_too_little_shared_memory_stops_before_the_first_sync_naming_shm_size(tmp_path):
    small = tmp_path / "shm"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)],
                             capture_output=True).returncode == 0
    try:  # a real 8 MB tmpfs when we may mount one (CI runs as root); else /dev/shm with more than it has
        path = str(small) if mounted else "/dev/shm"
        free = __import__("shutil").disk_usage(path).free
        with pytest.raises(SystemExit, match=r"--shm-size=\d+g"):
            check_shared_memory(free + 2**20, path)
        check_shared_memory(free // 2, path)  # room: no error
    finally:
        if mounted:
            subprocess.run(["umount", str(small)])


def test_the_chat_templates_turn_end_stops_a_base_model_and_ends_its_mask():
    tok = AutoTokenizer.from_pretrained(TINY)
    assert stop_token_ids(tok) == [tok.eos_token_id]  # the tiny model's EOS is its turn end
    base = AutoTokenizer.from_pretrained(TINY)
    base.eos_token = "<|endoftext|>"  # as Qwen2.5 base: EOS is not the chat template's <|im_end|>
    im_end = base.convert_tokens_to_ids("<|im_end|>")
    ids = stop_token_ids(base)
    assert ids == [base.eos_token_id, im_end]
    # no template, no turn end; the model's generation config still lists <|im_end|>, where vLLM stops too
    assert stop_token_ids(base, "raw") == [base.eos_token_id, im_end]
    completion = torch.tensor([[11, 12, im_end, 13, 14]])
    assert completion_mask(completion, ids).tolist() == [[1, 1, 1, 0, 0]]
    assert completion_mask(completion, base.eos_token_id).tolist() == [[1, 1, 1, 1, 1]]  # what EOS alone trained
    assert "<|im_start|>assistant" in make_prompt(base, "q")


@pytest.mark.slow  # ~55 s: the whole recipe starts
def test_the_recipe_stops_at_once_when_the_ref_server_dies_during_start_up():
    env = {**os.environ, "MODEL": "no/such-model-dir", "REF_DEVICE": "cpu", "PORT": "59893",
           "PATH": "/usr/bin:/bin"}  # no python of the project's on PATH: the recipe must take .venv's
    env.pop("PY", None)
    out = subprocess.run(["bash", "recipes/gsm8k.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "exited during start-up" in out.stderr, out.stderr[-2000:]


def test_gen_device_minus_one_leaves_out_the_gpu_the_local_reference_server_reports():
    # 3 GPUs: the trainer on 0, `CUDA_VISIBLE_DEVICES=1 python ref_server.py` on 1: vLLM takes 2
    assert generation_gpus(-1, 1, [0], [0, 1, 2], busy=[1]) == ([2], False)
    # 2 GPUs, the server on the other one: vLLM shares the trainer's (its 0.3 share), not the server's
    assert generation_gpus(-1, 1, [0], [0, 1], busy=[1]) == ([0], True)
    assert generation_gpus(1, 1, [0], [0, 1], busy=[1]) == ([1], False)  # a GPU named by the user is kept


def test_the_gpu_a_reference_server_reports_is_read_from_its_health_on_loopback_only(tmp_path):
    import requests
    from simple_grpo.devices import physical_gpu, reference_gpus
    from tools.launch import free_port, start_ref_server, stop
    assert physical_gpu("cpu") is None
    port = free_port()
    proc = start_ref_server(port, dict(os.environ))
    try:
        url = f"http://127.0.0.1:{port}"
        assert requests.get(url + "/health", timeout=10).json()["gpu"] is None  # on the CPU here
        assert reference_gpus(url) == []
    finally:
        stop(proc)
    assert reference_gpus(f"http://127.0.0.1:{port}", timeout=1) == []  # nobody answers: nothing left out
    assert reference_gpus("http://10.1.2.3:59875") == []  # another machine's GPUs are not this node's


@pytest.mark.parametrize("flag, value", [("gen_device", 1), ("gen_memory", 0.5)])
def test_gpu_placement_flags_are_refused_where_there_is_no_gpu(flag, value):
    # on a CPU machine vLLM runs on cores: a GPU number or a GPU memory share would be ignored
    import torch
    from simple_grpo.train import Config
    from simple_grpo.generation.workers import place_worker
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the flag places vLLM (the tests above)")
    with pytest.raises(SystemExit, match=rf"--{flag} {value}: this machine has no GPU.*--gen_threads"):
        place_worker(Config(**{flag: value}), 0)
    assert place_worker(Config(), 0)[2]  # the defaults: vLLM on CPU cores
