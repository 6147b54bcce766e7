"""tools/compare_runs.py: two runs' metrics.jsonl step by step, timings left out; a figure the second run adds
is listed, not compared; a figure it changed or lost makes the runs differ (exit 1)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_dir(tmp_path, name, rows):
    path = tmp_path / name
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def compare(a, b):
    out = subprocess.run([sys.executable, "tools/compare_runs.py", a, b], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    return out.returncode, json.loads(out.stdout.strip().splitlines()[-1])


BEFORE = [{"step": 1, "loss": 0.5, "kl": 0.0, "step_s": 3.0}, {"step": 2, "loss": 0.25, "kl": 0.01, "step_s": 2.0},
          {"step": 2, "warning": "kl", "message": "a doctor line"}]


def test_the_same_figures_with_other_timings_are_the_same(tmp_path):
    after = [{**row, "step_s": 9.0} if "loss" in row else row for row in BEFORE]
    code, result = compare(run_dir(tmp_path, "a", BEFORE), run_dir(tmp_path, "b", after))
    assert code == 0 and result["same"] and result["steps"] == 2


def test_a_changed_figure_differs_from_its_step_on(tmp_path):
    after = [dict(BEFORE[0]), {**BEFORE[1], "kl": 0.011}]
    code, result = compare(run_dir(tmp_path, "a", BEFORE), run_dir(tmp_path, "b", after))
    assert code == 1 and result["differing_keys"] == ["kl"] and result["first_differing_step"] == 2


def test_a_figure_the_second_run_adds_is_listed_and_one_it_lost_differs(tmp_path):
    added = [{**row, "sampler_gap_rows": 0} if "loss" in row else row for row in BEFORE]
    before = run_dir(tmp_path, "a", BEFORE)
    code, result = compare(before, run_dir(tmp_path, "b", added))
    assert code == 0 and result["added_keys"] == ["sampler_gap_rows"]
    lost = [{k: v for k, v in row.items() if k != "kl"} for row in BEFORE]
    code, result = compare(before, run_dir(tmp_path, "c", lost))
    assert code == 1 and result["lost_keys"] == ["kl"] and result["differing_keys"] == ["kl"]
