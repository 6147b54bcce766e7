"""Every flag of the trainers and the ref server has a one-line help under a header (simple_grpo/flags.py).
(The layering of modules and scripts: tests/test_layering.py.)"""
import importlib
import os
import subprocess
import sys

import pytest

from simple_grpo.flags import flag_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# every command line built from a config dataclass: (module, the dataclass)
COMMAND_LINES = [("grpo_train", "Config"), ("simple_grpo.train", "Config"), ("ref_server", "Config"),
                 ("evaluate", "EvalConfig"), ("simple_grpo.run.report", "ViewConfig"),
                 ("regroup_ver.ref_server_regroup", "RegroupConfig"),
                 ("tools.explain_step", "ExplainConfig"), ("tools.probe", "ProbeConfig"),
                 ("tools.build_tiny_model", "BuildConfig"), ("tools.fetch_smollm2", "FetchConfig")]


@pytest.mark.parametrize("module_name,class_name", COMMAND_LINES, ids=[m for m, _ in COMMAND_LINES])
def test_every_option_has_a_help_line(module_name, class_name):
    module = importlib.import_module(module_name)
    config_class = getattr(module, class_name)
    parser = flag_parser(config_class, module.__doc__)
    options = [a for a in parser._actions if a.dest != "help"]
    assert len(options) >= len(config_class.__dataclass_fields__)
    missing = [a.option_strings[0] for a in options if not (a.help and a.help.strip())]
    assert missing == []


def test_help_groups_the_trainers_flags_under_headers():
    out = subprocess.run([sys.executable, "-m", "simple_grpo.train", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0
    headers = ["model and data:", "sampling:", "objective (grpo_math.py):", "optimisation:",
               "LoRA (simple_grpo/lora.py):", "systems:", "output:",
               "the run doctor:", "the generation worker (vLLM):"]
    positions = [out.stdout.index("\n" + h) for h in headers]
    assert positions == sorted(positions)
    assert out.stdout.index("\n  --lr LR") > out.stdout.index("\noptimisation:")
    words = " ".join(out.stdout.split())  # argparse wraps the help text
    assert "AdamW's learning rate" in words and "1e-4 for the tiny default model and 1e-6 (TRL's) for any other" in words

