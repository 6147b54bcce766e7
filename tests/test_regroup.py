"""regroup_ver/: pools answers per question, serves only groups with mixed rewards and fresh answers,
and keeps its memory under the caps (the Pools class directly, then the live server); its advantages follow the
trainer's --advantage_eps and --scale_rewards, and it cuts pooled answers at the trainer's one stop set."""
import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import requests
import torch

from grpo_math import completion_mask, group_advantages
from simple_grpo.flags import parse_flags
from simple_grpo.generation.vllm_sampler import NO_LOGP
from simple_grpo.protocol import decode, encode
from simple_grpo.rollouts import make_groups
from simple_grpo.run.checkpoints import runs_root
from simple_grpo.task.problems import stop_token_ids
from regroup_ver.ref_server_regroup import Pools, RegroupConfig
from tests.test_faults import fresh
from tools.launch import ROOT, free_port, start_ref_server

EOS, PAD = 1, 0


def upload(question, rewards, version, answer_id, C=6, run_id="r"):
    """One uploaded group: G answers to `question`, with the advantages the generator computes (the default
    flags); answer j's sampler_logps are all -(answer_id + j)/1000, so a served row tells which upload it came from."""
    G = len(rewards)
    completion = torch.full((G, C), 7)
    completion[:, -1] = EOS
    sampler_logps = -(answer_id + torch.arange(G, dtype=torch.float32))[:, None].expand(G, C) / 1000
    rewards = torch.tensor(rewards, dtype=torch.float32)
    tensors = {"prompt_ids": torch.tensor([5, 6, question]), "completion_ids": completion,
               "rewards": rewards, "advantages": group_advantages(rewards, G), "sampler_logps": sampler_logps.clone()}
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


def test_served_advantages_follow_the_servers_advantage_eps_and_scale_rewards():
    rewards = [0.5, 0.5, 0.5, 0.502]  # std 0.001: the eps added to it matters

    def served(*flags):  # the server's command line, as ref_server_regroup.py parses it
        pools = Pools(parse_flags(RegroupConfig, args=["--num_generations", "4", *flags]), EOS, PAD)
        tensors, _ = pools.take_group(pools.add(*upload(3, rewards, 0, 0)))
        return tensors["rewards"], tensors["advantages"]

    r, default = served()
    _, wide = served("--advantage_eps", "0.01")
    _, unscaled = served("--scale_rewards", "none", "--advantage_eps", "0.01")
    centred, std = r - r.mean(), r.std()
    assert torch.allclose(default, centred / (std + 1e-4)) and torch.allclose(wide, centred / (std + 0.01))
    assert torch.allclose(wide / default, (std + 1e-4) / (std + 0.01))  # 0.0011 / 0.011: eps 100x, 10x smaller
    assert torch.allclose(unscaled, centred)  # none: r - mean, no std and no eps


def test_the_trainers_uploads_pass_the_servers_check_with_its_flags_and_are_refused_naming_the_flag_otherwise():
    from regroup_ver.ref_server_regroup import check_upload
    Q, G, C, STOP = 6, 8, 10, 2  # STOP: the tiny model's <|im_end|>, its one stop id
    rng = torch.Generator().manual_seed(0)
    rewards = torch.tensor([0.0, 0.5, 1.0, 1.5])[torch.randint(0, 4, (Q * G,), generator=rng)]
    lengths = torch.randint(1, C, (Q * G,), generator=rng)
    completion_ids = torch.where(torch.arange(C) < lengths[:, None], 7, PAD)
    completion_ids[torch.arange(Q * G), lengths - 1] = STOP
    until_stop = completion_mask(completion_ids, STOP)
    flags = [("group", 1e-4), ("group", 0.05), ("none", 1e-4)]
    for scale, eps in flags:  # the generator's groups, as simple_grpo/train.py's worker makes them with --regroup
        groups, has_signal = make_groups([torch.tensor([5, 6, q]) for q in range(Q)], completion_ids, until_stop,
                                         rewards, G, {}, torch.zeros(Q * G, C), keep_equal=True,
                                         scale_rewards=scale, eps=eps)
        assert has_signal.sum() >= 4
        for server_scale, server_eps in flags:
            cfg = RegroupConfig(scale_rewards=server_scale, advantage_eps=server_eps)
            for (tensors, _), signal in zip(groups, has_signal.tolist()):
                if (server_scale, server_eps) == (scale, eps) or not signal:  # all alike: 0 with any flags
                    check_upload(tensors, cfg, [STOP], PAD)
                else:
                    with pytest.raises(ValueError, match="--scale_rewards and --advantage_eps"):
                        check_upload(tensors, cfg, [STOP], PAD)


def test_the_server_refuses_scale_rewards_batch_by_name_before_loading_its_model():
    out = subprocess.run([sys.executable, "regroup_ver/ref_server_regroup.py", "--scale_rewards", "batch"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--scale_rewards batch: the regrouping server serves one question's group at a time" in out.stderr


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


@pytest.fixture(scope="module")
def base_like_model(tmp_path_factory):
    """The tiny model whose tokenizer's EOS is <|endoftext|> (0, also its pad), as Qwen2.5 base's: the chat turn
    end <|im_end|> (2) is then a stop id other than the tokenizer's EOS."""
    out = tmp_path_factory.mktemp("base_like")
    for name in os.listdir(os.path.join(ROOT, "models", "tiny-math")):
        shutil.copy(os.path.join(ROOT, "models", "tiny-math", name), out)
    path = out / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token": "<|endoftext|>"}))
    return str(out)


@pytest.fixture(scope="module")
def base_like_server(base_like_model):
    port = free_port()
    proc = start_ref_server(port, dict(os.environ), "--model", base_like_model, "--num_generations", "4",
                            script="regroup_ver/ref_server_regroup.py")
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=30)


PAD_BASE, TURN_END = 0, 2  # the base-like model's <|endoftext|> (its pad and EOS) and <|im_end|>


def turn_end_upload(question, lengths, rewards, version=0, answer_id=0):
    """A group as the generator uploads it: answer j is lengths[j] tokens, the last the chat turn end, then
    padding to the group's longest; its sampler_logps are -(answer_id + j + 1)/100 on its tokens, NO_LOGP on the
    padding (as vLLM's sampler pads them)."""
    G, C = len(lengths), max(lengths)
    completion, sampler_logps = torch.full((G, C), PAD_BASE), torch.full((G, C), NO_LOGP)
    for j, n in enumerate(lengths):
        completion[j, :n - 1], completion[j, n - 1] = 7, TURN_END
        sampler_logps[j, :n] = -(answer_id + j + 1) / 100
    rewards = torch.tensor(rewards, dtype=torch.float32)
    return ({"prompt_ids": torch.tensor([5, 6, question]), "completion_ids": completion, "rewards": rewards,
             "advantages": group_advantages(rewards, G), "sampler_logps": sampler_logps},
            {"run_id": "r", "policy_version": version})


def test_live_server_cuts_pooled_answers_at_the_chat_turn_end_not_only_the_tokenizers_eos(base_like_model,
                                                                                           base_like_server):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(base_like_model)
    assert stop_token_ids(tok, "chat", base_like_model) == [tok.eos_token_id, TURN_END] == [PAD_BASE, TURN_END]
    lengths = {0: [2, 3, 2, 8], 10: [2, 2, 2, 2]}  # answer_id -> its upload's answer lengths
    # all wrong, padded to its longest answer (8), then all right: the group served is the freshest right answer
    # and the first three wrong ones (2, 3 and 2 tokens), so none of the 8-token answer's padding belongs in it
    for answer_id, version, reward in ((0, 0, 0.5), (10, 1, 1.5)):
        r = post(base_like_server, *turn_end_upload(30, lengths[answer_id], [reward] * 4, version, answer_id))
        assert r.status_code == 200, r.text
    r = requests.get(base_like_server + "/get", params={"wait": 10}, timeout=30)
    assert r.status_code == 200
    served, _ = decode(r.content)
    assert sorted(served["rewards"].tolist()) == [0.5, 0.5, 0.5, 1.5]
    assert served["completion_ids"].size(1) == 3  # the longest served answer: no padding carried along
    for row, logps in zip(served["completion_ids"], served["sampler_logps"]):
        answer = round(-logps[0].item() * 100) - 1  # answer_id + j
        n = lengths[answer - answer % 10][answer % 10]
        assert row[:n].tolist() == [7] * (n - 1) + [TURN_END]
        assert (row[n:] == PAD_BASE).all() and (logps[n:] == NO_LOGP).all() and (logps[:n] < 0).all()


def test_live_server_refuses_uploads_made_with_other_flags_naming_them(base_like_server):
    url = base_like_server
    tensors, meta = turn_end_upload(31, [3, 5, 2, 4], [0.5, 1.5, 0.5, 0.5])
    assert post(url, tensors, meta).status_code == 200  # the server's own flags (the defaults) pass
    for flags, named in ((dict(eps=0.05), "--advantage_eps"), (dict(scale_rewards="none"), "--scale_rewards")):
        tensors, meta = turn_end_upload(32, [3, 5, 2, 4], [0.5, 1.5, 0.5, 0.5])
        tensors["advantages"] = group_advantages(tensors["rewards"], 4, **flags)  # the trainer's other flags
        r = post(url, tensors, meta)
        assert r.status_code == 400 and named in r.json()["error"]
    tensors, meta = turn_end_upload(33, [3, 5, 2, 4], [0.5, 1.5, 0.5, 0.5])
    tensors["completion_ids"][0, 4] = 7  # answer 0 went on past its turn end: the trainer's stop set differs
    r = post(url, tensors, meta)
    assert r.status_code == 400 and "--prompt_format" in r.json()["error"]


@pytest.mark.slow
def test_the_regroup_trainer_runs_end_to_end():
    port = free_port()
    server = start_ref_server(port, dict(os.environ), script="regroup_ver/ref_server_regroup.py")
    try:
        out = subprocess.run([sys.executable, "regroup_ver/grpo_regroup.py", "--ref_url", f"http://127.0.0.1:{port}",
                              "--steps", "4", "--run_name", fresh("test_regroup"), "--batch_prompts", "4"],
                             cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        rows = [json.loads(line) for line in open(os.path.join(runs_root(), "test_regroup", "metrics.jsonl"))]
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert all(0 <= r["policy_lag"] <= 4 for r in rows)  # the server's --max_policy_lag
        assert rows[-1]["trained"] == 4 * 4 * 8  # 4 steps of 4 groups of 8
    finally:
        server.terminate()
        server.wait(timeout=30)
