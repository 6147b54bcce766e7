#!/usr/bin/env bash
# Can this machine's NVIDIA driver run the CUDA that requirements.txt's torch and vLLM are built for?
#   bash tools/check_gpu_driver.sh [requirements.txt]   # exit 0: yes; 1: no, with a message naming both
# tools/install.sh runs it before installing the GPU requirements. torch 2.13.0's and vLLM 0.32.0's wheels
# are built for CUDA 13, which needs driver 580 or newer: on an older driver they install without a
# complaint, and torch then sees no GPU while nvidia-smi still answers, far from the cause.
set -euo pipefail
cd "$(dirname "$0")/.."
req="${1:-requirements.txt}"
needed=580  # CUDA 13.0's least Linux driver (NVIDIA's CUDA toolkit release notes: 580.65.06)
pins=$(grep -E '^(torch|vllm)==' "$req" | tr '\n' ' ' | sed 's/ $//')
version=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ' || true)
major="${version%%.*}"
if ! [[ "$major" =~ ^[0-9]+$ ]]; then
    echo "check_gpu_driver.sh: nvidia-smi did not report a driver version (it said '$version'): is the NVIDIA driver loaded?" >&2
    exit 1
fi
if (( major < needed )); then
    cat >&2 <<END
The NVIDIA driver here is $version, but $req pins $pins, built for CUDA 13, which needs driver $needed or newer.
The install would succeed and torch would then see no GPU. Ways out:
  - update the NVIDIA driver to $needed or newer, then run this again;
  - or install the CPU requirements (everything runs there, slowly): SIMPLE_GRPO_REQUIREMENTS=requirements-cpu.txt make install
  - or write a requirements file with a torch and vLLM pair built for your driver's CUDA, and pass it the same way
    (SIMPLE_GRPO_REQUIREMENTS=FILE). This project has checked no such pair: vLLM 0.26.0's torch 2.11.0 is built for CUDA 13 too.
END
    exit 1
fi
echo "NVIDIA driver $version: $needed or newer, as $pins (CUDA 13) need"
