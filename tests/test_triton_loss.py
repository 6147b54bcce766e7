"""triton_loss/: the kernels match torch autograd (tests/triton_kernel_cases.py, in Triton's CPU
interpreter), and without a Triton backend the trainers fall back to torch with one warning."""
import os
import subprocess
import sys
import warnings

import pytest
import torch

from triton_loss import choose_loss_impl

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


def test_without_a_triton_backend_the_trainer_falls_back_to_torch_with_one_warning(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: Triton can run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert choose_loss_impl("triton") == "torch"
        assert choose_loss_impl("torch") == "torch"
    assert len(caught) == 1 and "using the torch implementation" in str(caught[0].message)
    with pytest.raises(ValueError, match="loss_impl"):
        choose_loss_impl("cuda")
