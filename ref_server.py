"""The reference server: holds the frozen reference model and adds its log-probs to rollouts.

    python ref_server.py                                  # tiny default model, 127.0.0.1:59875
    python ref_server.py --model Qwen/Qwen2.5-0.5B --port 59875 --device cuda:0

Generators POST groups of rollouts to /upload; a worker thread computes the reference
model's per-token log-probs (for the KL term) and queues the finished group; trainers
GET /get to take finished groups in the order they arrived (FIFO). Keeping the reference
model here leaves the trainer's device its memory, and lets it live on another GPU or
machine. Messages are safetensors bytes (protocol.py), never pickle.

It is safe to leave running: every upload is checked and a bad one gets a 4xx with a
reason; the queues are bounded in groups and in bytes (a full queue answers 503 and
clients back off); at most --max_connections are served at once (more get 429), each
cut off --conn_timeout seconds after it opened; /stats counts what happened. It listens on 127.0.0.1 unless --host
says otherwise, and then only with a shared token (--token or $SIMPLE_GRPO_TOKEN):

    SIMPLE_GRPO_TOKEN=secret python ref_server.py --host 0.0.0.0   # trainers pass --ref_token
"""
import hmac
import ipaddress
import json
import math
import os
import queue
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import bottle
import torch

from grpo_math import sequence_logps
from flags import flag, parse_flags
from protocol import TOKEN_ENV, check_rollout, decode, encode


@dataclass
class ServerConfig:
    model: str = flag("models/tiny-math", "the reference model (usually the policy's starting point)")
    host: str = flag("127.0.0.1", "the address to listen on: loopback only unless told otherwise")
    token: str = flag("", "shared secret every request must carry (default: $SIMPLE_GRPO_TOKEN); needed off loopback")
    port: int = flag(59875, "the port to listen on")
    device: str = flag("cpu", "where the reference model runs: cpu, cuda, cuda:1, ...")
    dtype: str = flag("float32", "float32, bfloat16 or float16")
    threads: int = flag(1, "CPU threads for the reference forward pass")
    max_queue: int = flag(256, "groups waiting in each direction; /upload answers 503 when full")
    max_queue_mb: int = flag(512, "... or when the uploads held in the queues pass this many MB")
    max_body_mb: int = flag(16, "the largest upload, in MB")
    max_group_size: int = flag(256, "the most completions in one group")
    max_connections: int = flag(64, "connections served at once; more get 429 and are closed")
    conn_timeout: float = flag(60.0, "seconds a connection may stay open: slow or stalled senders are cut off")


def add_ref_logps(model, tensors, meta, device):
    """tensors["ref_logps"] (G, C): the reference model's per-token log-probs of the completions."""
    prompt = tensors["prompt_ids"].to(device).unsqueeze(0)  # one prompt, G completions
    with torch.inference_mode():
        ref_logps = sequence_logps(model, prompt, torch.ones_like(prompt), tensors["completion_ids"].to(device),
                                   temperature=meta.get("temperature", 1.0))
    tensors["ref_logps"] = ref_logps.float().cpu()


def ref_worker(model, todo, done, device, stats, lock):
    """Take uploaded groups in order, add ref_logps (G, C), queue them for trainers."""
    while True:
        size, tensors, meta = todo.get()
        try:
            add_ref_logps(model, tensors, meta, device)
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
    """Finished groups waiting for trainers, oldest first, at most `maxsize`. A trainer may ask for
    its own run's groups only: the ranks of a multi-GPU run share one server, each with its run_id.
    When full, a group older than `stale_s` (a run that stopped taking its groups) makes room."""

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
        def first():
            return next((i for i, (r, _, _) in enumerate(self.items) if run_id in (None, r)), None)
        with self.changed:
            self.changed.wait_for(lambda: first() is not None, timeout)
            if (i := first()) is None:
                raise queue.Empty
            self.changed.notify_all()
            return self.items.pop(i)[2]

    def qsize(self):
        return len(self.items)


def answer(status, reason):
    """An error response: HTTP status and a one-line JSON reason."""
    return bottle.HTTPResponse(json.dumps({"error": reason}), status=status, content_type="application/json")


def add_token_check_and_health(app, cfg, stats):
    """With cfg.token set, every request must carry 'Authorization: Bearer TOKEN' or get 401.
    GET /health answers JSON."""
    started = time.time()

    @app.get("/health")
    def health():
        return {"status": "ok", "model": cfg.model, "uptime_s": round(time.time() - started, 1)}

    @app.hook("before_request")
    def check_token():
        sent = bottle.request.get_header("Authorization", "")
        if cfg.token and not hmac.compare_digest(sent.encode(), f"Bearer {cfg.token}".encode()):
            stats["rejected"] += 1
            raise answer(401, "missing or wrong token (send 'Authorization: Bearer TOKEN')")


def read_rollout(cfg, model_config, stats):
    """The uploaded group as (body size, tensors, meta), checked; raises a 4xx answer otherwise.
    The body's declared size is checked before it is read."""
    limit = cfg.max_body_mb * 2**20
    try:
        size = bottle.request.content_length
    except ValueError:
        size = -1
    status, reason = (411, "Content-Length required") if size < 0 else \
                     (413, f"body of {size} bytes > {cfg.max_body_mb} MB") if size > limit else (0, "")
    if not status:
        try:
            tensors, meta = decode(bottle.request.body.read(limit))
            check_rollout(tensors, meta, model_config.vocab_size, model_config.max_position_embeddings,
                          cfg.max_group_size)
            return size, tensors, meta
        except ValueError as e:
            status, reason = 400, str(e)
        except (OSError, bottle.HTTPError) as e:  # the sender hung up mid-body, or sent broken chunks
            status, reason = 400, f"the body could not be read ({type(e).__name__})"
    stats["rejected"] += 1
    raise answer(status, reason)


def make_app(model, cfg: ServerConfig):
    app = bottle.Bottle()
    todo, done = queue.Queue(cfg.max_queue), Finished(cfg.max_queue)
    stats = {"groups_in": 0, "groups_out": 0, "groups_taken": 0, "rejected": 0, "rejected_full": 0,
             "errors": 0, "queued_bytes": 0}
    lock, started = threading.Lock(), time.time()
    threading.Thread(target=ref_worker, args=(model, todo, done, cfg.device, stats, lock),
                     daemon=True).start()
    add_token_check_and_health(app, cfg, stats)

    @app.post("/upload")
    def upload():
        size, tensors, meta = read_rollout(cfg, model.config, stats)
        with lock:  # bounded in bytes as well as in groups: memory stays bounded under any flood
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


def wait_seconds():
    """/get's ?wait=: how long to wait for a finished group (0 to 30 s)."""
    try:
        wait = float(bottle.request.query.get("wait") or 0)
    except ValueError:
        wait = math.nan
    if math.isnan(wait):
        raise answer(400, "wait must be a number of seconds")
    return min(max(wait, 0.0), 30.0)


class ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most max_connections at once: one more gets an immediate 429
    and is closed. Every connection is cut conn_timeout seconds after it was accepted, so a slow
    or stalled sender cannot keep a thread, and memory stays bounded (max_connections bodies)."""
    daemon_threads = True  # a waiting /get must not block uploads
    request_queue_size = 1024  # connections the kernel holds until accepted (the default, 5, drops bursts)

    def __init__(self, address, handler, max_connections, conn_timeout):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.slots, self.conn_timeout = threading.BoundedSemaphore(max_connections), conn_timeout
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            refuse(request, 429, "too many connections at once: retry later")
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)  # a new thread runs process_request_thread

    def process_request_thread(self, request, client_address):
        cut = threading.Timer(self.conn_timeout, close_quietly, args=(request,))
        cut.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            cut.cancel()
            self.slots.release()

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], OSError):  # a client that hung up or was cut off is no error
            super().handle_error(request, client_address)


def refuse(sock, status, reason):
    """A one-line JSON answer written straight to a socket no thread will serve."""
    body = json.dumps({"error": reason}).encode()
    head = (f"HTTP/1.0 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    try:
        sock.settimeout(1.0)
        sock.sendall(head.encode() + body)
    except OSError:
        pass


def close_quietly(sock):
    """Cut a connection from another thread: the thread reading or writing it sees the end at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class QuietHandler(WSGIRequestHandler):
    default_request_version = "HTTP/1.0"  # so even a malformed request line's answer has a status line

    def log_message(self, *args):  # a line per request (or per bad one) would flood the log; see /stats
        pass

    def parse_request(self):
        if not super().parse_request():
            return False
        if len(self.headers.get_all("Content-Length", [])) > 1:  # which body would be the upload?
            self.send_error(400, "more than one Content-Length header")
            return False
        return True

    def send_error(self, code, message=None, explain=None):
        # the parser answers "HTTP/2.0" in a request line with 505; this server reads it as a bad request
        super().send_error(400 if code == 505 else code, message, explain)


def is_loopback(host):
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_model(cfg):
    """The frozen reference model, after refusing an exposed address without a token."""
    cfg.token = cfg.token or os.environ.get(TOKEN_ENV, "")
    if not is_loopback(cfg.host) and not cfg.token:
        raise SystemExit(f"refusing to listen on {cfg.host} without a token: anyone who reaches it could feed "
                         f"the trainer. Set --token or {TOKEN_ENV} (trainers pass it as --ref_token).")
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(cfg.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype).to(cfg.device).eval()
    return model.requires_grad_(False)


def serve(app, cfg, name="ref server"):
    server = ThreadingWSGIServer((cfg.host, cfg.port), QuietHandler, cfg.max_connections, cfg.conn_timeout)
    server.set_app(app)
    print(f"{name}: {cfg.model} on {cfg.device}, listening on http://{cfg.host}:{cfg.port}", flush=True)
    server.serve_forever()


def main(cfg: ServerConfig):
    model = load_model(cfg)
    serve(make_app(model, cfg), cfg)


if __name__ == "__main__":
    main(parse_flags(ServerConfig, __doc__))
