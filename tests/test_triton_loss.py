"""triton_loss/: the kernels match torch autograd (tests/triton_kernel_cases.py, in Triton's CPU
interpreter), and without a Triton backend --loss_impl triton is refused, naming the way out."""
import os
import subprocess
import sys

import pytest
import torch

from triton_loss import check_loss_impl

HERE = os.path.dirname(os.path.abspath(__file__))


def test_kernels_match_torch_autograd_in_the_triton_interpreter():
    """Triton decides at its first import whether its functions (tl.max too) are compiled or
    interpreted, and this session may have imported it already (vLLM does): so the kernel cases
    run in a fresh pytest process with TRITON_INTERPRET=1, and every one of them must pass."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.join(HERE, "triton_kernel_cases.py")], env=env, cwd=os.path.dirname(HERE),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]


def test_without_a_triton_backend_loss_impl_triton_is_refused_naming_torch(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: Triton can run")
    with pytest.raises(SystemExit, match="--loss_impl triton: no GPU for Triton .* use --loss_impl torch"):
        check_loss_impl("triton")
    check_loss_impl("torch")
    with pytest.raises(SystemExit, match="loss_impl"):
        check_loss_impl("cuda")


def test_the_trainer_refuses_loss_impl_triton_before_it_loads_anything():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: Triton can run")
    r = subprocess.run([sys.executable, "-m", "simple_grpo.train", "--loss_impl", "triton", "--beta", "0", "--steps",
                        "1"], cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--loss_impl triton: no GPU for Triton" in r.stdout + r.stderr
    assert "generation worker" not in r.stdout  # stopped before any process started
