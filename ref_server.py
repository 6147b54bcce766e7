"""The reference server: generators POST groups to /upload, a thread adds the frozen reference model's log-probs,
trainers GET /get them, oldest first. Queues are bounded in groups and bytes (full: 503).

    python ref_server.py --model Qwen/Qwen2.5-0.5B --device cuda:0   # default: the tiny model on 127.0.0.1:59875
    SIMPLE_GRPO_TOKEN=secret python ref_server.py --host 0.0.0.0     # off loopback a token is needed (--ref_token)
"""
import queue
import sys
import threading
import time

import bottle
import torch

from simple_grpo.flags import parse_flags
from simple_grpo.logprobs import load_reference, sequence_logps
from simple_grpo.protocol import ServerConfig, encode
from simple_grpo.http_server import (add_token_check_and_health, answer, check_exposure, read_rollout, serve,
                                     wait_seconds)


def ref_worker(model, todo, done, stats, lock):
    """Take uploaded groups in order, add ref_logps (G, C) at the group's sampling temperature, queue them."""
    while True:
        size, tensors, meta = todo.get()
        try:
            t0 = time.time()
            prompt = tensors["prompt_ids"].to(model.device)[None]  # (1, P): the group's one prompt, unpadded
            logps = sequence_logps(model, prompt, torch.ones_like(prompt), tensors["completion_ids"].to(model.device),
                                   meta.get("temperature", 1.0))  # (G, C)
            tensors["ref_logps"] = logps.float().cpu()
            stats["ref_s"] += time.time() - t0
            dropped = done.put(meta.get("run_id"), (size, encode(tensors, meta)))  # waits while trainers are behind
            with lock:
                stats["queued_bytes"] -= sum(stale_size for stale_size, _ in dropped)
            stats["groups_out"] += 1
        except Exception as e:  # noqa: BLE001 - report, keep serving
            with lock:
                stats["queued_bytes"] -= size
            stats["errors"] += 1
            print(f"ref_worker: group dropped: {type(e).__name__}: {e}", file=sys.stderr)


class Finished:
    """Finished groups, oldest first, at most maxsize, taken by run_id; when full, one older than stale_s makes room."""

    def __init__(self, maxsize, stale_s=600.0):
        self.items, self.maxsize, self.stale_s, self.changed = [], maxsize, stale_s, threading.Condition()

    def put(self, run_id, item):
        """Add item, waiting for room; returns the stale items dropped to make it."""
        dropped = []
        with self.changed:
            while len(self.items) >= self.maxsize:
                if time.time() - self.items[0][1] > self.stale_s:
                    dropped.append(self.items.pop(0)[2])
                else:
                    self.changed.wait(timeout=1.0)
            self.items.append((run_id, time.time(), item))
            self.changed.notify_all()
        return dropped

    def get(self, run_id=None, timeout=0.0):
        """The oldest item (of run_id, if given); queue.Empty if none comes within timeout."""
        def of_run():
            return [i for i, (r, _, _) in enumerate(self.items) if run_id in (None, r)]
        with self.changed:
            if not (found := self.changed.wait_for(of_run, timeout)):
                raise queue.Empty
            self.changed.notify_all()  # room for a waiting put
            return self.items.pop(found[0])[2]

    def qsize(self):
        return len(self.items)


def make_app(model, cfg: ServerConfig):
    app = bottle.Bottle()
    todo, done = queue.Queue(cfg.max_queue), Finished(cfg.max_queue)
    stats = {"groups_in": 0, "groups_out": 0, "groups_taken": 0, "rejected": 0, "rejected_full": 0,
             "errors": 0, "queued_bytes": 0, "ref_s": 0.0}
    lock, started = threading.Lock(), time.time()
    threading.Thread(target=ref_worker, args=(model, todo, done, stats, lock), daemon=True).start()
    add_token_check_and_health(app, cfg, stats)

    @app.post("/upload")
    def upload():
        size, tensors, meta = read_rollout(cfg, model.config, stats)
        with lock:
            if stats["queued_bytes"] + size > cfg.max_queue_mb * 2**20 or todo.full():
                stats["rejected_full"] += 1
                return answer(503, "queue full: retry later")
            stats["queued_bytes"] += size
            todo.put_nowait((size, tensors, meta))
        stats["groups_in"] += 1
        return {"ok": True}

    @app.get("/get")
    def get():
        """The oldest finished group (of ?run_id=, if given) as safetensors bytes; 204 if none within ?wait= seconds."""
        try:
            size, body = done.get(bottle.request.query.get("run_id") or None, timeout=wait_seconds())
        except queue.Empty:
            return bottle.HTTPResponse(status=204)
        with lock:
            stats["queued_bytes"] -= size
        stats["groups_taken"] += 1
        bottle.response.content_type = "application/octet-stream"
        return body

    @app.get("/stats")
    def stats_():
        return {"waiting": todo.qsize(), "ready": done.qsize(), "uptime_s": round(time.time() - started, 1), **stats}

    return app


def main(cfg: ServerConfig):
    check_exposure(cfg)  # before the model loads
    serve(make_app(load_reference(cfg), cfg), cfg)


if __name__ == "__main__":
    main(parse_flags(ServerConfig, __doc__))
