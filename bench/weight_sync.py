"""bench/weight_sync.py: one in-memory weight sync to a running vLLM worker, against the disk route.

    python bench/weight_sync.py [--repeats 3] [--models tiny,qwen2.5-0.5b-config]

The worker is a spawned process holding a vLLM engine, as in grpo_vllm_one.py.
  in memory: WeightSender (simple_grpo/generation/weight_sync.py: one copy into a shared-memory
             buffer, a message on a queue) and the worker's receive_weights (reload_weights +
             reset_prefix_cache);
  disk:      save_pretrained to a directory, then the worker's reload_weights(weights_path=...).
Both times run from the trainer starting the sync to the worker answering that it is done.
Models: the tiny default, and a random-weight model with Qwen2.5-0.5B's config (fp32, built
here; no download). Prints one JSON line per model (medians over --repeats), and a breakdown
of the in-memory time on stderr.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.harness import SamplerConfig  # noqa: E402
from simple_grpo.generation.vllm_sampler import start_vllm  # noqa: E402
from simple_grpo.generation.weight_sync import WeightSender, receive_weights  # noqa: E402

# Qwen/Qwen2.5-0.5B's config.json, the fields that set the shapes
QWEN05 = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
              rms_norm_eps=1e-6, tie_word_embeddings=True, torch_dtype="float32")


def worker(model_dir, requests, loaded, replies):
    """A vLLM engine that loads weights on request and answers when done."""
    llm = start_vllm(SamplerConfig(model=model_dir, max_model_len=256))
    replies.put("ready")
    shared = {}
    while (message := requests.get()) != "stop":
        t0 = time.time()
        if message[0] == "disk":
            llm.collective_rpc("reload_weights", kwargs={"weights_path": message[1]})
            llm.reset_prefix_cache()
        elif receive_weights(llm, message, shared, loaded) is None:
            continue  # the shared buffers, sent once before the first weights
        replies.put({"received": t0, "load_s": time.time() - t0})


def build_qwen05_config_model(path):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN05)).float()
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(os.path.join(ROOT, "models", "tiny-math")).save_pretrained(path)


def bench(name, model_dir, repeats):
    from transformers import AutoModelForCausalLM
    trainer_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ctx = mp.get_context("spawn")
    requests, loaded, replies = ctx.Queue(), ctx.Value("i", 0), ctx.Queue()
    sender = WeightSender([requests], [loaded])
    proc = ctx.Process(target=worker, args=(model_dir, requests, loaded, replies))
    proc.start()
    try:
        assert replies.get(timeout=600) == "ready"
        memory, disk, parts = [], [], []
        for i in range(1, repeats + 2):  # the first sync also allocates the buffers: not timed
            t0 = time.time()
            sender.send(trainer_model, version=i)
            reply = replies.get(timeout=600)
            if i == 1:
                continue
            memory.append(time.time() - t0)
            parts.append({"copy_and_send_s": reply["received"] - t0, "load_s": reply["load_s"]})

            save_dir = tempfile.mkdtemp(prefix="weight_sync_")
            t0 = time.time()
            trainer_model.save_pretrained(save_dir)
            requests.put(("disk", save_dir))
            replies.get(timeout=600)
            disk.append(time.time() - t0)
            shutil.rmtree(save_dir)
        requests.put("stop")
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()
    med = {k: round(statistics.median(p[k] for p in parts), 3) for k in parts[0]}
    print(f"{name}: in-memory breakdown (median) {med}", file=sys.stderr)
    m, d = statistics.median(memory), statistics.median(disk)
    return {"model": name, "in_memory_s": round(m, 3), "disk_s": round(d, 3), "speedup": round(d / m, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="tiny,qwen2.5-0.5b-config")
    args = ap.parse_args()
    for name in args.models.split(","):
        if name == "tiny":
            print(json.dumps(bench(name, os.path.join(ROOT, "models", "tiny-math"), args.repeats)), flush=True)
        elif name == "qwen2.5-0.5b-config":
            with tempfile.TemporaryDirectory(prefix="qwen05_random_") as d:
                build_qwen05_config_model(d)
                print(json.dumps(bench(name, d, args.repeats)), flush=True)
        else:
            raise SystemExit(f"unknown model {name!r}: tiny or qwen2.5-0.5b-config")


if __name__ == "__main__":
    main()
