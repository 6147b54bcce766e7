"""The guide's reading path is one default step of grpo_train.py, traced (tools/reading_path.py), and counted from
the code as it is: the guide's copy is checked against it, and a slow test traces the step again."""
import json
import os
import re
import tempfile

import pytest

from tools import reading_path
from tools.reading_path import RECORD, ROOT, count, table


def recorded():
    with open(RECORD) as f:
        return json.load(f)


def entered(file, name, *callers, globals=()):
    """A trace's entry: file's function name, entered from callers [(file, name)] (none: the script's top)."""
    return {"file": file, "name": name, "callers": [list(c) for c in callers] or [[]], "globals": list(globals)}


def trace(*entries, fields=()):
    return {"trainer": {"entered": list(entries), "fields": [list(f) for f in fields]},
            "server": {"entered": [], "fields": []}}


def test_the_guides_table_is_the_traced_step_counted_from_the_code_as_it_is():
    guide = open(os.path.join(ROOT, "docs", "guide.md")).read()
    copy = re.search(r"<!-- reading-path: python tools/reading_path.py -->\n(.*?)\n<!-- /reading-path -->", guide, re.S)
    assert copy, "docs/guide.md has no reading-path block"
    assert copy.group(1) == table(recorded()), \
        "docs/guide.md's reading path is stale: paste `python tools/reading_path.py`"


def test_a_function_entered_counts_its_whole_span():
    rows, _ = count(trace(entered("grpo_math.py", "grpo_objective")))
    node = reading_path.definitions("grpo_math.py")[0]["grpo_objective"]
    assert rows["grpo_math.py"]["functions"] == {"grpo_objective": node.end_lineno - node.lineno + 1}
    assert rows["grpo_math.py"]["lines"] == node.end_lineno - node.lineno + 1


def test_a_module_constant_read_is_counted_where_it_is_assigned_through_imports():
    rows, _ = count(trace(entered("simple_grpo/trainer/config.py", "default_ref_url", globals=["DEFAULT_REF_URL"])))
    assert "DEFAULT_REF_URL" in rows["simple_grpo/protocol.py"]["constants"]  # imported from there
    assert rows["simple_grpo/protocol.py"]["lines"] == 1


def test_a_config_field_read_counts_its_declaration_unless_left_out_code_read_it():
    fields = [("simple_grpo/trainer/config.py", "TrainerConfig", "beta", "grpo_train.py", "main"),
              ("simple_grpo/trainer/config.py", "TrainerConfig", "save_every", "simple_grpo/run/checkpoints.py", "x")]
    rows, _ = count(trace(entered("grpo_train.py", "main"), fields=fields))
    assert rows["simple_grpo/trainer/config.py"]["fields"] == {"beta": 1}


def test_what_only_left_out_code_calls_is_left_out_and_named_with_why():
    checks = ("simple_grpo/trainer/config.py", "check_values")
    rows, left_out = count(trace(entered(*checks), entered("grpo_math.py", "group_advantages", checks),
                                 entered("grpo_math.py", "grpo_loss", checks, ("grpo_train.py", "main")),
                                 entered("grpo_train.py", "main")))
    assert "group_advantages" not in rows["grpo_math.py"]["functions"]  # only check_values called it
    assert "grpo_loss" in rows["grpo_math.py"]["functions"]  # main called it too
    assert ("simple_grpo/trainer/config.py:check_values", "refuses bad values, sets nothing") in left_out
    assert "- `simple_grpo/trainer/config.py:check_values`: refuses bad values, sets nothing" in table(
        trace(entered(*checks)))


def test_a_closure_is_read_with_the_function_around_it():
    route = entered("ref_server.py", "make_app.<locals>.get", ("simple_grpo/reference/http_server.py", "serve"))
    rows, _ = count(trace(entered("ref_server.py", "make_app"), route,
                          entered("ref_server.py", "Finished.get", ("ref_server.py", "make_app.<locals>.get")),
                          entered("simple_grpo/reference/http_server.py", "serve")))
    assert "Finished.get" in rows["ref_server.py"]["functions"]  # the route's call, though HTTP code called the route


def test_a_recorded_function_that_is_gone_is_named():
    with pytest.raises(SystemExit, match="grpo_math.py has no no_such_function now"):
        count(trace(entered("grpo_math.py", "no_such_function")))


@pytest.mark.slow
def test_tracing_the_default_step_again_gives_the_recorded_trace():
    with tempfile.TemporaryDirectory() as workdir:
        fresh = reading_path.trace_default_step(workdir)
    fresh = json.loads(json.dumps(fresh))  # as the record stores it
    for process in ("trainer", "server"):
        names = {(e["file"], e["name"]) for e in fresh[process]["entered"]}
        assert names == {(e["file"], e["name"]) for e in recorded()[process]["entered"]}, \
            "the step runs other functions than tools/reading_path.json says: python tools/reading_path.py --record"
    assert table(fresh) == table(recorded())
