"""A LoRA checkpoint as a whole model: the base it names, with the adapters merged in (HF format).

    python tools/merge_lora.py runs/lora/step_200                  # writes runs/lora/step_200/merged/
    python tools/merge_lora.py runs/lora/step_200 --out models/mine

A run with --use_peft saves each step_N/ as adapters in PEFT's format (a few MB); evaluate.py merges them
on the fly, and this writes the merged model once, for vLLM, another trainer or sharing.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from simple_grpo.lora import is_adapter_dir, merge_adapter_dir  # noqa: E402 - after the path fix


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a step_N/ directory of a --use_peft run")
    ap.add_argument("--out", default="", help="where to write the merged model (default: CHECKPOINT/merged)")
    args = ap.parse_args()
    if not is_adapter_dir(args.checkpoint):
        raise SystemExit(f"{args.checkpoint} holds no LoRA adapters (no adapter_config.json): nothing to merge")
    out = args.out or os.path.join(args.checkpoint, "merged")
    if os.path.exists(out) and os.listdir(out):
        raise SystemExit(f"{out} exists and is not empty: pass another --out, or remove it first")
    print(f"merged model: {merge_adapter_dir(args.checkpoint, out)}")


if __name__ == "__main__":
    main()
