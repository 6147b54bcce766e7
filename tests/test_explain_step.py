"""tools/explain_step.py: one GRPO step printed as a lesson, with the trainers' own functions."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_lesson_shows_each_part_of_a_step_and_the_policy_moves_the_right_way():
    out = subprocess.run([sys.executable, "tools/explain_step.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for part in ("1. THE PROMPT", "2. G = 6 COMPLETIONS", "3. GROUP-RELATIVE ADVANTAGES", "4. THE LOSS, TOKEN BY TOKEN",
                 "5. ONE ADAM STEP", "6. WHAT MOVED"):
        assert part in out.stdout
    assert re.search(r"gradient norm \d+\.\d+; the weights moved by \d", out.stdout)
    # after the step, every completion pushed up is more likely and every one pushed down less likely
    moved = re.findall(r"advantage ([+-]\d\.\d+)  ratio (\d\.\d+)", out.stdout)
    assert len(moved) == 6
    assert all((float(r) > 1) == (float(a) > 0) for a, r in moved if float(a) != 0)
