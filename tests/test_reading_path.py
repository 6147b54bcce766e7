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
    rows = {path: dict(functions or []) for path, functions, *_ in reading_path.reading_path()}
    assert "score" in rows["simple_grpo/task/rewards.py"] and "extract_answer" in rows["simple_grpo/task/rewards.py"]
    assert "sequence_logps" in rows["simple_grpo/logprobs.py"]  # what the server computes, followed from its entry
    defaults = rows["simple_grpo/trainer/config.py"]
    assert "default_lr" in defaults and "default_ref_url" in defaults


def test_the_careful_read_is_at_most_12_files_and_about_800_lines():
    rows = reading_path.reading_path()
    assert len(rows) <= 12 and sum(row[3] for row in rows) <= 810  # issue 51: at most 12 files, ~800 lines


def test_a_method_that_does_not_run_is_subtracted_from_its_class():
    import ast
    source = open(os.path.join(ROOT, "simple_grpo/logprobs.py")).read()
    cls = reading_path.definitions(ast.parse(source))["ChunkedLogProbs"]
    backward = next(node for node in cls.body if getattr(node, "name", None) == "backward")
    rows = {path: dict(functions or []) for path, functions, *_ in reading_path.reading_path()}
    assert rows["simple_grpo/logprobs.py"]["ChunkedLogProbs"] == reading_path.span(cls) - reading_path.span(backward)
    assert "ChunkedLogProbs.backward" in reading_path.table()  # named as not run


def test_plumbing_read_by_its_docstring_counts_the_docstring_and_not_its_calls():
    rows = {path: dict(functions or []) for path, functions, *_ in reading_path.reading_path()}
    protocol = rows["simple_grpo/protocol.py"]
    assert protocol["take_group"] < 10  # signature and docstring, not the polling loop
    assert "ref_request" not in protocol and "decode" not in protocol  # called only from the loops not read
    assert "`take_group` (" in table() and "its docstring; polls the server" in table()


def test_plumbing_without_a_docstring_is_refused():
    import ast
    defs = reading_path.definitions(ast.parse("def plumbing():\n    return 1\n"))
    with pytest.raises(SystemExit, match="plumbing is read by its docstring"):
        reading_path.docstring_span(defs["plumbing"])


def test_a_function_that_is_gone_is_named():
    with pytest.raises(SystemExit, match="grpo_math.py has no no_such_function"):
        followed(["no_such_function"], {}, "grpo_math.py")
