"""The guide's reading path for one default step of grpo_train.py is computed from the code, so it cannot go stale."""
import os
import re

import pytest

from tools import reading_path
from tools.reading_path import ROOT, followed, table


def test_the_guides_table_is_the_reading_path_computed_from_the_code():
    guide = open(os.path.join(ROOT, "docs", "guide.md")).read()
    copy = re.search(r"<!-- reading-path: python tools/reading_path.py -->\n(.*?)\n<!-- /reading-path -->", guide, re.S)
    assert copy, "docs/guide.md has no reading-path block"
    assert copy.group(1) == table(), "docs/guide.md's reading path is stale: paste `python tools/reading_path.py`"


def test_a_functions_calls_into_its_own_file_are_followed_and_counted():
    rows = {path: dict(functions or []) for path, functions, *_ in reading_path.reading_path()}
    assert "per_token_loss" in rows["grpo_math.py"] and "kl_estimate" in rows["grpo_math.py"]  # grpo_loss calls them
    assert "grad_norm" in rows["simple_grpo/trainer/update.py"]  # optimizer_step calls it


def test_a_call_only_another_option_makes_is_not_counted():
    rows = {path: dict(functions or []) for path, functions, *_ in reading_path.reading_path()}
    assert "check_lora" not in rows["simple_grpo/trainer/config.py"]  # check_options calls it with --use_peft only
    assert "check_lora" in reading_path.table()  # named as not run


def test_the_path_covers_scoring_the_reference_and_the_defaults():
    files = [path for path, *_ in reading_path.PATH]
    for needed in ("simple_grpo/task/rewards.py", "simple_grpo/reference/model.py", "simple_grpo/trainer/config.py"):
        assert needed in files


def test_a_function_that_is_gone_is_named():
    with pytest.raises(SystemExit, match="grpo_math.py has no no_such_function"):
        followed(["no_such_function"], {}, "grpo_math.py")
