"""regroup_ver/: pools answers per question, serves only groups with mixed rewards and fresh answers,
and keeps its memory under the caps (the Pools class directly, then the live server)."""
import json
import os
import random
import subprocess
import sys

import pytest
import requests
import torch

from grpo_math import group_advantages
from simple_grpo.protocol import decode, encode
from regroup_ver.ref_server_regroup import Pools, RegroupConfig
from tests.test_faults import fresh
from tools.launch import ROOT, free_port, start_ref_server

EOS, PAD = 1, 0


def upload(question, rewards, version, answer_id, C=6, run_id="r"):
    """One uploaded group: G answers to `question`; answer j's sampler_logps are all -(answer_id + j)/1000,
    so a served row tells which upload it came from."""
    G = len(rewards)
    completion = torch.full((G, C), 7)
    completion[:, -1] = EOS
    sampler_logps = -(answer_id + torch.arange(G, dtype=torch.float32))[:, None].expand(G, C) / 1000
    tensors = {"prompt_ids": torch.tensor([5, 6, question]), "completion_ids": completion,
               "rewards": torch.tensor(rewards, dtype=torch.float32), "advantages": torch.zeros(G),
               "sampler_logps": sampler_logps.clone()}
    return tensors, {"run_id": run_id, "policy_version": version, "temperature": 0.7}


def test_served_groups_have_mixed_rewards_and_no_answer_past_the_lag():
    cfg = RegroupConfig(num_generations=8, max_policy_lag=3, pool_size=32, max_questions=64)
    pools, rng, served, uploaded = Pools(cfg, EOS, PAD), random.Random(0), 0, {}
    for n in range(600):
        version = n // 10  # the policy moves on every 10 uploads
        question, p_right = rng.randrange(25), rng.choice([0.0, 0.1, 0.5, 0.9, 1.0])
        rewards = [1.5 if rng.random() < p_right else 0.5 for _ in range(8)]
        answer_id = 1000 * n
        for j in range(8):
            uploaded[answer_id + j] = (rewards[j], version)
        key = pools.add(*upload(question, rewards, version, answer_id))
        while (group := pools.take_group(key)) is not None:
            tensors, meta = group
            served += 1
            assert tensors["rewards"].std() > 0  # never a group that teaches nothing
            assert torch.equal(tensors["advantages"], group_advantages(tensors["rewards"], 8))
            assert min(meta["policy_versions"]) >= pools.newest - cfg.max_policy_lag
            assert meta["policy_version"] == min(meta["policy_versions"])
            for row in range(8):  # each answer keeps its own reward, version and behaviour log-probs
                answer = round(-tensors["sampler_logps"][row, 0].item() * 1000)
                assert uploaded[answer] == (tensors["rewards"][row].item(), meta["policy_versions"][row])
    assert served > 100 and pools.stats["answers_evicted"] > 0
    print(f"served {served} groups from 600 uploads; {pools.stats}")


def test_an_all_alike_group_waits_for_an_answer_with_another_reward():
    pools = Pools(RegroupConfig(num_generations=4), EOS, PAD)
    key = pools.add(*upload(3, [0.5] * 4, 0, 0))
    assert pools.take_group(key) is None
    key = pools.add(*upload(3, [0.5, 0.5, 0.5, 1.5], 1, 100))
    tensors, meta = pools.take_group(key)
    assert sorted(tensors["rewards"].tolist()) == [0.5, 0.5, 0.5, 1.5]
    assert pools.take_group(key) is None  # 4 answers left, all 0.5


def test_a_pool_yields_as_many_mixed_groups_as_its_rare_answers_allow():
    pools = Pools(RegroupConfig(num_generations=8), EOS, PAD)
    key = pools.add(*upload(4, [0.5] * 8, 0, 0))  # all wrong: pooled
    key = pools.add(*upload(4, [0.5] * 6 + [1.5] * 2, 1, 100))  # 2 right of 8 more
    groups = [pools.take_group(key), pools.take_group(key)]
    assert all(g is not None and sorted(g[0]["rewards"].tolist()) == [0.5] * 7 + [1.5] for g in groups)
    assert pools.take_group(key) is None and pools.sizes()["pool_answers"] == 0  # all 16 answers served


def test_pool_memory_stays_under_its_caps_while_questions_keep_arriving():
    cfg = RegroupConfig(num_generations=8, pool_size=16, max_questions=50, max_policy_lag=1000)
    pools, biggest = Pools(cfg, EOS, PAD), 0
    for n in range(5000):  # 5,000 new questions, all answers alike: nothing is ever served
        pools.add(*upload(n % 500, [0.5] * 8, n // 100, 0, C=20, run_id=str(n // 500)))
        sizes = pools.sizes()
        assert sizes["pool_questions"] <= 50 and sizes["pool_answers"] <= 50 * 16
        biggest = max(biggest, sizes["pool_bytes"])
    assert biggest <= 50 * 16 * 20 * 12  # answers x tokens x (8 bytes id + 4 bytes log-prob)


@pytest.fixture(scope="module")
def regroup_server():
    port = free_port()
    proc = start_ref_server(port, dict(os.environ), "--num_generations", "4", "--max_policy_lag", "2",
                            "--max_ready", "3", script="regroup_ver/ref_server_regroup.py")
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=30)


def post(url, tensors, meta):
    return requests.post(url + "/upload", data=encode(tensors, meta), timeout=30)


def test_live_server_serves_mixed_fresh_groups_with_reference_logps(regroup_server):
    url = regroup_server
    assert post(url, *upload(11, [0.5] * 4, 0, 0)).status_code == 200
    assert requests.get(url + "/get", params={"wait": 1}, timeout=30).status_code == 204  # all alike: pooled
    # the trainer reaches version 5: the version-0 answers are too old to serve now
    assert requests.get(url + "/get", params={"wait": 0, "policy_version": 5}, timeout=30).status_code == 204
    assert post(url, *upload(11, [0.5, 0.5, 1.5, 1.5], 5, 100)).status_code == 200
    r = requests.get(url + "/get", params={"wait": 10, "policy_version": 5}, timeout=30)
    assert r.status_code == 200
    tensors, meta = decode(r.content)
    assert meta["policy_versions"] == [5, 5, 5, 5] and tensors["rewards"].std() > 0
    assert tensors["ref_logps"].shape == tensors["completion_ids"].shape and torch.isfinite(tensors["ref_logps"]).all()
    stats = requests.get(url + "/stats", timeout=5).json()
    assert stats["answers_evicted"] == 4 and stats["groups_formed"] == 1
    # without behaviour log-probs or rewards (optional on the wire) an upload cannot be pooled
    for needed in ("sampler_logps", "rewards"):
        tensors, meta = upload(12, [0.5, 1.5, 0.5, 1.5], 5, 200)
        del tensors[needed]
        assert post(url, tensors, meta).status_code == 400
    # trainers behind: once max_ready groups wait, uploads get 503
    codes = [post(url, *upload(20 + i, [0.5, 1.5, 0.5, 1.5], 5, 300 + 10 * i)).status_code for i in range(6)]
    assert codes[:3] == [200] * 3 and 503 in codes[3:]


@pytest.mark.slow
def test_the_regroup_trainer_runs_end_to_end():
    port = free_port()
    server = start_ref_server(port, dict(os.environ), script="regroup_ver/ref_server_regroup.py")
    try:
        out = subprocess.run([sys.executable, "regroup_ver/grpo_regroup.py", "--ref_url", f"http://127.0.0.1:{port}",
                              "--steps", "4", "--run_name", fresh("test_regroup"), "--batch_prompts", "4"],
                             cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        rows = [json.loads(line) for line in open(os.path.join(ROOT, "runs", "test_regroup", "metrics.jsonl"))]
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert all(0 <= r["policy_lag"] <= 4 for r in rows)  # the server's --max_policy_lag
        assert rows[-1]["trained"] == 4 * 4 * 8  # 4 steps of 4 groups of 8
    finally:
        server.terminate()
        server.wait(timeout=30)
