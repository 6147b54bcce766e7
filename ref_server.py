"""The reference server: holds the frozen reference model and adds its log-probs to rollouts.

    python ref_server.py                                  # tiny default model, 127.0.0.1:59875
    python ref_server.py --model Qwen/Qwen2.5-0.5B --port 59875 --device cuda:0

Generators POST groups of rollouts to /upload; a worker thread computes the reference
model's per-token log-probs (for the KL term) and queues the finished group; trainers
GET /get to take finished groups in the order they arrived (FIFO). Keeping the reference
model here leaves the trainer's device its memory, and lets it live on another GPU or
machine. Messages are safetensors bytes (protocol.py), never pickle.
"""
import json
import queue
import sys
import threading
import time
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIServer

import bottle
import torch

from grpo_math import sequence_logps
from protocol import check_rollout, decode, encode


@dataclass
class ServerConfig:
    model: str = "models/tiny-math"  # the reference model (usually the policy's starting point)
    host: str = "127.0.0.1"  # loopback only unless told otherwise
    port: int = 59875
    device: str = "cpu"
    dtype: str = "float32"  # float32, bfloat16 or float16
    threads: int = 1  # CPU threads for the reference forward pass
    max_queue: int = 256  # groups waiting in each direction; /upload answers 503 when full
    max_body_mb: int = 64


def ref_worker(model, todo, done, device, stats):
    """Take uploaded groups in order, add ref_logps (G, C), queue them for trainers."""
    while True:
        tensors, meta = todo.get()
        try:
            prompt = tensors["prompt_ids"].to(device).unsqueeze(0)  # one prompt, G completions
            with torch.inference_mode():
                ref_logps = sequence_logps(model, prompt, torch.ones_like(prompt),
                                           tensors["completion_ids"].to(device),
                                           temperature=meta.get("temperature", 1.0))
            tensors["ref_logps"] = ref_logps.float().cpu()
            done.put(encode(tensors, meta))
            stats["groups_out"] += 1
        except Exception as e:  # noqa: BLE001 - report, keep serving
            stats["errors"] += 1
            print(f"ref_worker: group dropped: {type(e).__name__}: {e}", file=sys.stderr)


def make_app(model, cfg: ServerConfig):
    app = bottle.Bottle()
    todo, done = queue.Queue(cfg.max_queue), queue.Queue(cfg.max_queue)
    stats = {"groups_in": 0, "groups_out": 0, "groups_taken": 0, "rejected": 0, "errors": 0}
    started = time.time()
    vocab_size = model.config.vocab_size
    max_len = model.config.max_position_embeddings
    threading.Thread(target=ref_worker, args=(model, todo, done, cfg.device, stats), daemon=True).start()

    def reject(status, reason):
        stats["rejected"] += 1
        bottle.response.status = status
        bottle.response.content_type = "application/json"
        return json.dumps({"error": reason})

    @app.post("/upload")
    def upload():
        limit = cfg.max_body_mb * 2**20
        if (bottle.request.content_length or 0) > limit:
            return reject(413, f"body larger than {cfg.max_body_mb} MB")
        body = bottle.request.body.read(limit + 1)
        try:
            tensors, meta = decode(body)
            check_rollout(tensors, meta, vocab_size, max_len)
        except ValueError as e:
            return reject(400, str(e))
        try:
            todo.put_nowait((tensors, meta))
        except queue.Full:
            return reject(503, "queue full: retry later")
        stats["groups_in"] += 1
        return {"ok": True}

    @app.get("/get")
    def get():
        """The oldest finished group as safetensors bytes; 204 if none within ?wait= seconds."""
        wait = min(float(bottle.request.query.get("wait") or 0), 30.0)
        try:
            body = done.get(timeout=wait) if wait > 0 else done.get_nowait()
        except queue.Empty:
            bottle.response.status = 204
            return b""
        stats["groups_taken"] += 1
        bottle.response.content_type = "application/octet-stream"
        return body

    @app.get("/health")
    def health():
        return {"status": "ok", "model": cfg.model, "waiting": todo.qsize(), "ready": done.qsize(),
                "uptime_s": round(time.time() - started, 1), **stats}

    return app


class ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a waiting /get must not block uploads


def main(cfg: ServerConfig):
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(cfg.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype).to(cfg.device).eval()
    model.requires_grad_(False)
    app = make_app(model, cfg)
    print(f"ref server: {cfg.model} on {cfg.device}, listening on http://{cfg.host}:{cfg.port}", flush=True)
    bottle.run(app, host=cfg.host, port=cfg.port, server_class=ThreadingWSGIServer, quiet=True)


if __name__ == "__main__":
    from transformers import HfArgumentParser
    (server_config,) = HfArgumentParser(ServerConfig).parse_args_into_dataclasses()
    main(server_config)
