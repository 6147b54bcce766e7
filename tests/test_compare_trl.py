"""bench/compare_trl.py --start DIR: every system (TRL and ours) starts from DIR, with the world's recipe otherwise.
No system runs here: the bench's own functions are called with the trainers stood in for."""
import dataclasses
import os
import shutil

import pytest

from bench import compare_trl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "models", "tiny-math")


@pytest.fixture
def start(tmp_path):
    """A model directory to start from: the tiny model's config and tokenizer (no weights: nothing loads them)."""
    model_dir = tmp_path / "my-start"
    model_dir.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TINY, name), model_dir / name)
    return str(model_dir)


@pytest.fixture
def no_warm_start(monkeypatch):
    """make demo-real's warm start, which --start replaces: fetching and training it here would be an error."""
    def refuse(env, *args):
        raise AssertionError("--start given, yet the warm start was fetched and trained")
    monkeypatch.setattr(compare_trl, "smollm2_warm_start", refuse)


def test_without_start_each_world_keeps_its_own_start(monkeypatch):
    monkeypatch.setattr(compare_trl, "smollm2_warm_start", lambda env: ("base", "base-warm-1234"))
    assert compare_trl.parse_args([]).start is None
    assert compare_trl.world_settings("tiny", {})["model"] == compare_trl.MODEL
    assert compare_trl.world_settings("smollm2", {})["model"] == "base-warm-1234"


@pytest.mark.parametrize("world", ["tiny", "smollm2"])
def test_start_replaces_the_model_and_nothing_else_of_the_recipe(world, start, monkeypatch, no_warm_start):
    args = compare_trl.parse_args(["--world", world, "--start", start])
    assert args.start == start
    given = compare_trl.world_settings(world, {}, args.start)
    monkeypatch.setattr(compare_trl, "smollm2_warm_start", lambda env: ("base", "base-warm-1234"))
    usual = compare_trl.world_settings(world, {})
    assert given["model"] == start
    assert {k: v for k, v in given.items() if k != "model"} == {k: v for k, v in usual.items() if k != "model"}


def test_a_relative_start_is_made_absolute_for_the_systems_run_from_the_repository_root(start, monkeypatch):
    monkeypatch.chdir(os.path.dirname(start))
    assert compare_trl.parse_args(["--start", "my-start"]).start == start


def test_every_system_gets_the_start(start, monkeypatch, no_warm_start):
    """Ours get it as --model; TRL's process gets --start and builds the same world from it."""
    w = compare_trl.world_settings("smollm2", {}, start)
    ours = {}

    def fake_run(trainer, steps, skip, env, flags, **kwargs):
        ours[trainer] = flags
        return {"trainer": trainer, "peak_rss_mb": 1, "peak_rss_with_ref_mb": 2}
    monkeypatch.setattr(compare_trl, "run", fake_run)
    compare_trl.run_ours("full", 64, 20, 3, {}, 0, "smollm2", w)
    assert ours["full"][ours["full"].index("--model") + 1] == start
    import grpo_train
    import grpo_vllm_one
    for lesson in (grpo_train, grpo_vllm_one):  # SmolLM2's recipe trains LoRA adapters, with its own system prompt
        name = lesson.__name__
        with pytest.raises(SystemExit, match=f"the lesson \\({name}\\) has no LoRA"):
            compare_trl.run_ours(name, 64, 20, 3, {}, 0, "smollm2", w)
        compare_trl.run_ours(name, 32, 20, 3, {}, 0, "tiny", compare_trl.world_settings("tiny", {}))
        lesson_flags = {f"--{f.name}" for f in dataclasses.fields(lesson.Config)}
        assert {f for f in ours[name] if f.startswith("--")} <= lesson_flags  # the tiny world: its own flags

    class Launched(Exception):
        pass

    def fake_popen(cmd, **kwargs):
        raise Launched(cmd)
    monkeypatch.setattr(compare_trl.subprocess, "Popen", fake_popen)
    with pytest.raises(Launched) as launched:
        compare_trl.run_trl(64, 20, 3, {}, "off", 0, "smollm2", w, start)
    child_argv = launched.value.args[0][2:]  # after python and the script
    trained = {}
    monkeypatch.setattr(compare_trl, "trl_train", lambda *args: trained.update(w=args[-1]))
    compare_trl.main(child_argv)
    assert trained["w"] == w


def test_the_result_line_names_a_given_start_only(start):
    figures = {"completions_per_s": 1.0}
    given = compare_trl.result_line(compare_trl.parse_args(["--start", start]), "trl", 32, figures)
    usual = compare_trl.result_line(compare_trl.parse_args([]), "trl", 32, figures)
    assert given["start"] == start
    assert usual == {"system": "trl", "world": "tiny", "completion_len": 32, "seed": 0, "completions_per_s": 1.0,
                     "steps": 30, "timed_steps": 27}  # the line as before --start
    assert list(given) == ["system", "world", "start", *list(usual)[2:]]  # beside the world


def test_a_start_that_is_not_a_directory_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match=r"--start .*nowhere: no such directory"):
        compare_trl.world_settings("tiny", {}, str(tmp_path / "nowhere"))


@pytest.mark.parametrize("remove, message", [
    (["config.json"], r"it lacks config\.json; save one with model\.save_pretrained"),
    (["tokenizer.json"], r"it lacks a tokenizer \(one of tokenizer\.json, tokenizer\.model, vocab\.json, vocab\.txt\)"),
    (["config.json", "tokenizer.json"], r"it lacks config\.json and a tokenizer"),
])
def test_a_start_without_config_or_tokenizer_is_an_error_naming_what_is_missing(start, remove, message):
    for name in remove:
        os.remove(os.path.join(start, name))
    with pytest.raises(SystemExit, match=message):
        compare_trl.world_settings("smollm2", {}, start)


def test_a_lora_checkpoint_as_start_is_told_to_merge_it_first(tmp_path):
    adapters = tmp_path / "step_40"
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text("{}")
    (adapters / "tokenizer.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"lacks config\.json \(it holds LoRA adapters: `python tools/merge_lora\.py"):
        compare_trl.world_settings("smollm2", {}, str(adapters))


def test_the_table_gives_each_row_its_ratio_to_trl_at_its_length_and_the_lag_seen():
    lines = [{"system": "trl", "completion_len": 32, "completions_per_s": 20.0, "s_per_step": 3.2, "peak_rss_mb": 1800},
             {"system": "full_lag2", "completion_len": 32, "completions_per_s": 130.0, "s_per_step": 0.4,
              "s_per_step_iqr": [0.25, 0.79], "policy_lag_mean": 1.52, "policy_lag_max": 2, "peak_rss_mb": 3200},
             {"system": "full_lag1", "completion_len": 256, "completions_per_s": 32.0, "s_per_step": 1.85,
              "s_per_step_iqr": [1.46, 2.25], "policy_lag_mean": 1, "policy_lag_max": 1, "peak_rss_mb": 3800},
             {"system": "trl", "completion_len": 256, "completions_per_s": 8.0, "s_per_step": 7.2, "peak_rss_mb": 3000}]
    rows = compare_trl.table(lines).splitlines()[2:]
    assert rows == ["| trl | 32 | 20.0 | 1.00 | 3.200 |  | 1800 |",
                    "| full_lag2 | 32 | 130.0 | 6.50 | 0.400 (0.250-0.790) | 1.52 / 2 | 3200 |",
                    "| trl | 256 | 8.0 | 1.00 | 7.200 |  | 3000 |",
                    "| full_lag1 | 256 | 32.0 | 4.00 | 1.850 (1.460-2.250) | 1 / 1 | 3800 |"]
