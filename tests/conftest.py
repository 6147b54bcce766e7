import os
import shutil
import sys

# tests import the project's modules (simple_grpo.*, grpo_math, evaluate, tools.*) from the repo root
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# the suite's own runs are runs/test_*: a new session starts them afresh (the trainers refuse to
# write into a used run directory without --resume or --overwrite)
for name in os.listdir(os.path.join(ROOT, "runs")) if os.path.isdir(os.path.join(ROOT, "runs")) else []:
    if name.startswith("test_"):
        shutil.rmtree(os.path.join(ROOT, "runs", name), ignore_errors=True)
