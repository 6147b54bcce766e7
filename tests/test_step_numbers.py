"""Every number a default step of the full trainer uses is a flag: its --help lists it with its default, and the
step reads that value (every field of its Config; the optimizer DeepSpeed builds, the loss's options). The
lessons, grpo_train.py and grpo_vllm_one.py, write AdamW's numbers into their DeepSpeed dict instead:
tests/test_grpo_train_copies.py and tests/test_lesson.py hold their dicts and flags equal to the full trainer's."""
import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys

import pytest

from grpo_math import group_advantages, grpo_loss
from simple_grpo.trainer.update import loss_options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINERS = ("-m simple_grpo.train",)  # what follows `python`
OPTIMIZER = ("lr", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "max_grad_norm")
CHANGED = {"lr": 3e-5, "adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6, "weight_decay": 0.1,
           "max_grad_norm": 0.5}
# what DeepSpeed's optimizer holds for a step started with each list of flags: its first parameter group, the clip
ENGINE = """
import json, sys
from simple_grpo.train import Config
from simple_grpo.flags import parse_flags
from simple_grpo.trainer.config import check_options
from simple_grpo.trainer.deepspeed_engine import leave_process_group, make_engine
for flags in json.loads(sys.argv[1]):
    cfg = parse_flags(Config, args=flags)
    check_options(cfg)
    engine, _ = make_engine(cfg)
    group = engine.optimizer.param_groups[0]
    print(json.dumps({"lr": group["lr"], "adam_beta1": group["betas"][0], "adam_beta2": group["betas"][1],
                      "adam_epsilon": group["eps"], "weight_decay": group["weight_decay"],
                      "max_grad_norm": engine.gradient_clipping()}))
leave_process_group()
"""


def help_of(script):
    """{flag: (its help text, its default as --help prints it)} from `python script --help`."""
    out = subprocess.run([sys.executable, *script.split(), "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    options = {}
    for block in re.split(r"\n(?=  --|\S)", out.stdout):  # an option, or a section's header
        name = re.match(r"  --(\w+)", block)
        if name:
            text = " ".join(block.split())
            default = re.search(r".*\(default: (.*)\)$", text)  # the last thing the formatter adds
            options[name.group(1)] = (text, default.group(1) if default else None)
    return options


@pytest.fixture(scope="module")
def helps():
    return {script: help_of(script) for script in TRAINERS}


@pytest.fixture(scope="module")
def engines():
    """The optimizer's numbers in a default step, and in one started with the flags CHANGED."""
    changed = [arg for name, value in CHANGED.items() for arg in (f"--{name}", str(value))]
    out = subprocess.run([sys.executable, "-c", ENGINE, json.dumps([[], changed])], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    default, changed = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {"default": default, "changed": changed}


def same(value, printed):
    """Whether --help printed value as the default."""
    if isinstance(value, float) and not isinstance(value, bool):
        try:
            return float(printed) == value
        except (TypeError, ValueError):
            return False
    return printed == " ".join(str(value).split())  # the help's whitespace is folded


def test_the_optimizer_of_a_default_step_holds_the_defaults_help_lists(helps, engines):
    used = engines["default"]
    for script in TRAINERS:
        for name in OPTIMIZER[1:]:
            assert same(used[name], helps[script][name][1]), (script, name, used[name], helps[script][name])
        # --lr's default depends on the model: its help gives the tiny model's value
        assert helps[script]["lr"][1] == "None" and "1e-4 for the tiny default model" in helps[script]["lr"][0]
    assert used["lr"] == 1e-4


def test_the_optimizer_takes_each_number_from_its_flag(engines):
    assert engines["changed"] == CHANGED


def test_the_loss_options_of_a_default_step_are_the_defaults_help_lists_and_grpo_losss_own(helps):
    from simple_grpo.train import Config
    from simple_grpo.trainer.config import check_options
    cfg = Config()
    check_options(cfg)
    options = loss_options(cfg)
    flag_of = {"max_completion_length": "max_new_tokens", "impl": "loss_impl"}
    signature = inspect.signature(grpo_loss).parameters
    for option, value in options.items():
        name = flag_of.get(option, option)
        for script in TRAINERS:
            printed = helps[script][name][1]
            if option == "epsilon_high":  # None: --epsilon's value, a symmetric clip
                assert printed == "None" and value == cfg.epsilon, value
            else:
                assert same(value, printed), (script, option, value, printed)
        if option == "max_completion_length":  # no default: only dr_grpo reads it, and refuses None
            assert signature[option].default is None
        else:
            assert signature[option].default == getattr(Config, name), option
    # the advantages' epsilon: the flag's default is group_advantages' own, and --help lists it
    assert inspect.signature(group_advantages).parameters["eps"].default == Config.advantage_eps
    assert all(same(Config.advantage_eps, helps[script]["advantage_eps"][1]) for script in TRAINERS)


def test_every_config_field_of_the_full_trainer_is_a_flag_with_its_default_in_help(helps):
    """Every field, so every one a default step reads (tools/reading_path.py no longer traces the fields read)."""
    import simple_grpo.train
    for script in TRAINERS:
        for field in dataclasses.fields(simple_grpo.train.Config):
            assert field.name in helps[script], (script, field.name)
            assert same(getattr(simple_grpo.train.Config, field.name), helps[script][field.name][1]), (
                script, field.name, helps[script][field.name])


def test_a_deepspeed_files_optimizer_numbers_become_the_flags_the_run_records(tmp_path, capsys):
    from simple_grpo.train import Config
    from simple_grpo.trainer.config import check_options
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_clipping": 0.5, "optimizer": {"params": {
        "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}}}))
    cfg = Config(deepspeed=str(path))
    check_options(cfg)
    assert (cfg.adam_beta1, cfg.adam_beta2, cfg.adam_epsilon, cfg.weight_decay, cfg.max_grad_norm) == \
        (0.8, 0.95, 1e-6, 0.1, 0.5)
    out = capsys.readouterr().out.splitlines()
    for name, value in (("adam_beta2", "0.95"), ("adam_epsilon", "1e-06"), ("max_grad_norm", "0.5")):
        assert f"  * {name} {value}: from --deepspeed {path}" in out


def test_the_guides_step_numbers_are_what_the_full_trainer_prints_for_make_demos_flags(capsys):
    """docs/guide.md's "Reading one step of make demo" copies the block simple_grpo.train prints at start for the
    flags tools/demo.py passes it (--ref_url to its server, tools/launch.py's TINY_WORLD_FLAGS, the run's own),
    and its command passes those flags."""
    from simple_grpo.train import Config
    from simple_grpo.flags import parse_flags
    from simple_grpo.trainer.config import check_options
    from tools.launch import TINY_WORLD_FLAGS
    cfg = parse_flags(Config, args=["--ref_url", "http://127.0.0.1:1", *TINY_WORLD_FLAGS, "--run_name",
                                    "demo_vllm_seed0", "--overwrite", "--seed", "0", "--steps", "650"])
    capsys.readouterr()
    check_options(cfg)
    printed = capsys.readouterr().out.strip()
    with open(os.path.join(ROOT, "docs", "guide.md")) as f:
        guide = f.read()
    copy = re.search(r"<!-- step-numbers: [^\n]* -->\n```\n(.*?)\n```\n<!-- /step-numbers -->", guide, re.DOTALL)
    assert copy, "docs/guide.md has no block <!-- step-numbers: ... --> ``` ... ``` <!-- /step-numbers -->"
    assert copy.group(1) == printed, f"docs/guide.md's step numbers differ from what the trainer prints:\n{printed}"
    assert f"python -m simple_grpo.train --ref_url http://127.0.0.1:PORT {' '.join(TINY_WORLD_FLAGS)} " in guide
