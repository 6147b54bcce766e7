"""ref_server.py: the frozen reference model behind HTTP. Generators POST groups to /upload, a thread adds
the reference log-probs at each group's sampling temperature, trainers GET /get them, oldest first, each run
its own. A lesson file, whole in itself: tests/test_ref_server_copies.py holds its message format, checks,
fingerprint and flags equal to the full trainer's (simple_grpo/protocol.py).

    python ref_server.py                                          # the tiny default model on 127.0.0.1:59875
    python ref_server.py --model Qwen/Qwen2.5-0.5B --device cuda:0     # it must hold the trainer's --model
    SIMPLE_GRPO_TOKEN=secret python ref_server.py --host 0.0.0.0       # off loopback a token is needed
"""
import glob, hashlib, hmac, ipaddress, json, math, os, queue, socket, sys, threading, time
from contextlib import suppress
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import bottle
import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open
from safetensors.torch import load, save
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from grpo_math import completion_logps


def flag(default, help, **more):  # a Config field: the flag --name, with this help
    return field(default=default, metadata={"help": help, **more})


@dataclass
class Config:
    model: str = flag("models/tiny-math", "the reference model (usually the policy's starting point)")
    host: str = flag("127.0.0.1", "the address to listen on: loopback only unless told otherwise")
    token: str = flag("", "secret each request must carry (default: $SIMPLE_GRPO_TOKEN); needed off loopback")
    port: int = flag(59875, "the port to listen on")
    device: str = flag("auto", "where the model runs: auto (the first visible GPU, else cpu), cpu, cuda:1")
    dtype: str = flag("auto", "auto: bfloat16 on a GPU, float32 on a CPU (which has no bf16 units)",
                      choices=["auto", "float32", "bfloat16", "float16"])
    threads: int = flag(1, "CPU threads for the reference forward pass")
    max_queue: int = flag(256, "groups waiting in each direction; /upload answers 503 when full")
    max_queue_mb: int = flag(512, "... or when the uploads held in the queues pass this many MB")
    max_body_mb: int = flag(16, "the largest upload, in MB")
    max_group_size: int = flag(256, "the most completions in one group")
    max_connections: int = flag(64, "connections served at once; more get 429 and are closed")
    conn_timeout: float = flag(60.0, "seconds a connection may stay open: slow or stalled senders are cut")


def parse_flags(args=None):  # transformers' HfArgumentParser makes each Config field a flag
    parser = HfArgumentParser(Config, description=__doc__.split("\n\n")[0])
    return Config(**vars(parser.parse_args(args)))


# ---------------------------------------------------------------- a message: safetensors bytes, no pickle
VERSION = 2  # of the message format: a message of another version is refused
TOKEN_ENV = "SIMPLE_GRPO_TOKEN"  # the shared secret, when the server listens beyond loopback
FLOAT_TENSORS = ("rewards", "advantages", "sampler_logps")  # optional: what a group carries on to its trainer


def encode(tensors, meta):  # meta goes in the header, as JSON
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    return save(tensors, metadata={"json": json.dumps({"version": VERSION, **meta})})


def decode(body):
    """(tensors, meta) from encode's bytes; ValueError with a reason on anything else. Runs no code."""
    try:
        tensors = load(body)  # checks the header's length and every tensor's byte range against the body's
        meta = json.loads(json.loads(body[8:8 + int.from_bytes(body[:8], "little")])["__metadata__"]["json"])
    except Exception as e:  # noqa: BLE001 - any parse failure is the sender's error
        raise ValueError(f"not a valid message: {type(e).__name__}: {str(e)[:120]}") from None
    if not isinstance(meta, dict) or meta.get("version") != VERSION:
        raise ValueError(f"not a message of protocol version {VERSION}")
    return tensors, meta


def check_rollout(tensors, meta, vocab_size, max_len, max_group_size):
    """ValueError naming the problem unless this is a well-formed group: token ids prompt_ids (P,) and
    completion_ids (G, C); optional finite rewards (G,), advantages (G,), sampler_logps (G, C); T > 0."""
    needed = {"prompt_ids", "completion_ids"}
    if not needed <= set(tensors) <= needed | set(FLOAT_TENSORS):
        raise ValueError(f"a group has {sorted(needed)} and maybe {FLOAT_TENSORS}: not {sorted(tensors)}")
    prompt, completion = tensors["prompt_ids"], tensors["completion_ids"]
    if prompt.dim() != 1 or completion.dim() != 2 or prompt.numel() == 0 or completion.numel() == 0:
        raise ValueError(f"prompt_ids must be (P,) and completion_ids (G, C), none empty; got shapes "
                         f"{tuple(prompt.shape)} and {tuple(completion.shape)}")
    (G, C), P = completion.shape, prompt.numel()
    if G > max_group_size or P + C > max_len:
        raise ValueError(f"{G} completions, {P} + {C} tokens: at most {max_group_size}, {max_len} tokens")
    for name, t in (("prompt_ids", prompt), ("completion_ids", completion)):
        if t.dtype != torch.int64 or t.min() < 0 or t.max() >= vocab_size:
            raise ValueError(f"{name} must be int64 token ids in the vocabulary [0, {vocab_size}): {t.dtype}")
    for name in FLOAT_TENSORS:
        t, shape = tensors.get(name), ((G, C) if name == "sampler_logps" else (G,))
        if t is not None and (t.dtype not in (torch.float32, torch.float64) or t.shape != shape
                              or not t.isfinite().all()):
            raise ValueError(f"{name} must be finite float32/64 of shape {shape}: {t.dtype} {tuple(t.shape)}")
    version, temperature = meta.get("policy_version", 0), meta.get("temperature", 1.0)
    if type(version) is not int or type(temperature) not in (int, float) or not 0 < temperature < math.inf:
        raise ValueError(f"need an int policy_version, a temperature > 0: not {version!r}, {temperature!r}")


# ---------------------------------------------------------------- the model: which one it is, its log-probs
def model_fingerprint(model):
    """What /health says it serves, for a trainer to compare with its own --model: hashes of the token table
    and of each safetensors tensor's shape and first, middle, last rows in bf16, and the config's fields."""
    vocab = sorted(AutoTokenizer.from_pretrained(model).get_vocab().items())
    config = AutoConfig.from_pretrained(model).to_dict()
    for name in ("dtype", "torch_dtype", "transformers_version", "_name_or_path", "use_cache"):
        config.pop(name, None)  # may differ between copies of one model: storage dtype, saver, path, a switch
    directory = model if os.path.isdir(model) else snapshot_download(model, allow_patterns=["*.safetensors"])
    weights = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):  # pickles are never opened
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                tensor, shape = f.get_slice(name), f.get_slice(name).get_shape()
                rows = [tensor[i:i + 1] for i in sorted({0, shape[0] // 2, shape[0] - 1})] if len(shape) > 1 \
                    else [f.get_tensor(name)]
                sample = torch.cat([row.reshape(-1) for row in rows]).to(torch.bfloat16).view(torch.int16)
                data = str(shape).encode() + sample.numpy().tobytes()
                weights[name] = hashlib.sha256(data).hexdigest()[:16]
    return {"token_table": hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16],
            "config": json.loads(json.dumps(config, default=str)),  # as sent: int keys become strings
            "weights": weights}


def ref_worker(model, todo, finished, changed, stats):
    """Take uploaded groups in order, add ref_logps (G, C) at the group's temperature, finish them."""
    while True:
        size, tensors, meta = todo.get()
        try:
            t0, prompt_ids = time.time(), tensors["prompt_ids"].to(model.device)[None]  # (1, P), unpadded
            with torch.inference_mode():
                ref_logps, _ = completion_logps(model, prompt_ids, torch.ones_like(prompt_ids),
                                                tensors["completion_ids"].to(model.device),
                                                meta.get("temperature", 1.0))
            tensors["ref_logps"] = ref_logps.cpu()  # (G, C) float32
            stats["ref_s"] += time.time() - t0
            with changed:  # wakes the trainers waiting in /get
                finished.append({"run_id": meta.get("run_id"), "time": time.time(), "size": size,
                                 "body": encode(tensors, meta)})
                changed.notify_all()
            stats["groups_out"] += 1
        except Exception as e:  # noqa: BLE001 - report, keep serving
            stats["errors"] += 1
            print(f"ref_worker: group dropped: {type(e).__name__}: {e}", file=sys.stderr)


# ---------------------------------------------------------------- HTTP: bounded connections, checked uploads
class Server(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most max_connections (more get 429), each cut after conn_timeout s."""
    daemon_threads = True  # a waiting /get must not block uploads
    request_queue_size = 1024  # connections the kernel holds until accepted (the default, 5, drops bursts)

    def __init__(self, cfg):
        self.address_family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        self.slots, self.conn_timeout = threading.BoundedSemaphore(cfg.max_connections), cfg.conn_timeout
        super().__init__((cfg.host, cfg.port), Handler)

    def process_request(self, request, client_address):
        if self.slots.acquire(blocking=False):
            return super().process_request(request, client_address)  # its thread: process_request_thread
        body = b'{"error": "too many connections at once: retry later"}'
        with suppress(OSError):  # no slot: answered here, by no thread
            request.settimeout(1.0)
            request.sendall(b"HTTP/1.0 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        self.shutdown_request(request)

    def process_request_thread(self, request, client_address):
        cut = threading.Timer(self.conn_timeout, close_quietly, (request,))
        cut.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            cut.cancel()
            self.slots.release()

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], OSError):  # a client that hung up or was cut off is no error
            super().handle_error(request, client_address)


def close_quietly(sock):  # from another thread: the thread reading or writing it sees the end at once
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class Handler(WSGIRequestHandler):
    default_request_version = "HTTP/1.0"  # so even a malformed request line's answer has a status line

    def log_message(self, *args):  # a line per request would flood the log: /stats counts them
        pass

    def parse_request(self):
        ok = super().parse_request()
        if ok and len(self.headers.get_all("Content-Length", [])) > 1:  # which body would be the upload?
            self.send_error(400, "more than one Content-Length header")
            return False
        return ok

    def send_error(self, code, message=None, explain=None):  # "HTTP/2.0" gets 505 there: a 400 here
        super().send_error(400 if code == 505 else code, message, explain)


def make_app(model, cfg, stale_s=600.0):  # stale_s: see /upload
    app, started = bottle.Bottle(), time.time()
    todo = queue.Queue(cfg.max_queue)  # uploaded groups (size, tensors, meta), oldest first
    finished, changed = [], threading.Condition()  # groups with their ref_logps, oldest first; its lock
    stats = {"groups_in": 0, "groups_out": 0, "groups_taken": 0, "rejected": 0, "rejected_full": 0,
             "groups_stale": 0, "errors": 0, "ref_s": 0.0}
    threading.Thread(target=ref_worker, args=(model, todo, finished, changed, stats), daemon=True).start()
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count()))))
    gpu = gpus.split(",")[model.device.index or 0].strip() if model.device.type == "cuda" else ""
    about = {"model": cfg.model, "fingerprint": model_fingerprint(cfg.model), "device": cfg.device,
             "dtype": cfg.dtype, "gpu": int(gpu) if gpu.isdigit() else None}  # gpu: as nvidia-smi numbers it

    def queued_bytes():  # the uploads the queues hold (list() copies one at once, whatever other threads do)
        return sum(item[0] for item in list(todo.queue)) + sum(group["size"] for group in list(finished))

    def refuse(status, reason):  # an error answer with a one-line JSON reason, counted in /stats
        stats["rejected_full" if status == 503 else "rejected"] += 1
        return bottle.HTTPResponse(json.dumps({"error": reason}), status, content_type="application/json")

    @app.hook("before_request")
    def check_token():
        sent = bottle.request.get_header("Authorization", "")
        if cfg.token and not hmac.compare_digest(sent.encode(), f"Bearer {cfg.token}".encode()):
            raise refuse(401, "missing or wrong token (send 'Authorization: Bearer TOKEN')")

    @app.get("/health")
    def health():
        return {"status": "ok", **about, "uptime_s": round(time.time() - started, 1)}

    @app.post("/upload")
    def upload():
        """One group, checked (its declared size before it is read), queued for its reference log-probs."""
        try:
            size = bottle.request.content_length  # -1: none declared
            if size < 0:
                return refuse(411, "Content-Length required")
            if size > cfg.max_body_mb * 2**20:
                return refuse(413, f"body of {size} bytes > {cfg.max_body_mb} MB")
            tensors, meta = decode(bottle.request.body.read(size))
            check_rollout(tensors, meta, model.config.vocab_size, model.config.max_position_embeddings,
                          cfg.max_group_size)
        except ValueError as e:  # a Content-Length that is no number too
            return refuse(400, str(e))
        except (OSError, bottle.HTTPError) as e:  # the sender hung up mid-body, or sent broken chunks
            return refuse(400, f"the body could not be read ({type(e).__name__})")
        with changed:  # one upload at a time is checked against the queues' room and added
            if len(finished) >= cfg.max_queue and time.time() - finished[0]["time"] > stale_s:
                finished.pop(0)  # full, and the oldest group waited stale_s: its run stopped taking
                stats["groups_stale"] += 1
            full = len(finished) >= cfg.max_queue or todo.full()
            if full or queued_bytes() + size > cfg.max_queue_mb * 2**20:
                return refuse(503, "queue full: retry later")
            todo.put_nowait((size, tensors, meta))
        stats["groups_in"] += 1
        return {"ok": True}

    @app.get("/get")
    def get():
        """The oldest finished group (of ?run_id=, if given) as bytes; 204 if none within ?wait= seconds."""
        try:
            wait = float(bottle.request.query.get("wait") or 0)
            if math.isnan(wait):
                raise ValueError
        except ValueError:
            return refuse(400, "wait must be a number of seconds")
        run_id = bottle.request.query.get("run_id") or None

        def of_run():  # the places of run_id's finished groups (of any run's, for None)
            return [i for i, group in enumerate(finished) if run_id in (None, group["run_id"])]
        with changed:
            if not (found := changed.wait_for(of_run, min(max(wait, 0.0), 30.0))):
                return bottle.HTTPResponse(status=204)
            body = finished.pop(found[0])["body"]
        stats["groups_taken"] += 1
        bottle.response.content_type = "application/octet-stream"
        return body

    @app.get("/stats")
    def stats_():
        return {"waiting": todo.qsize(), "ready": len(finished), "queued_bytes": queued_bytes(),
                "uptime_s": round(time.time() - started, 1), **stats}

    return app


def main(cfg):
    cfg.token = cfg.token or os.environ.get(TOKEN_ENV, "")
    loopback = cfg.host == "localhost"
    with suppress(ValueError):  # a host name is no IP address
        loopback = ipaddress.ip_address(cfg.host).is_loopback
    if not loopback and not cfg.token:  # said before the model loads
        raise SystemExit(f"refusing to listen on {cfg.host} without a token: anyone who reaches it could "
                         f"feed the trainer. Set --token or {TOKEN_ENV} (trainers pass it as --ref_token).")
    torch.set_num_threads(cfg.threads)
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.dtype == "auto":
        cfg.dtype = "float32" if torch.device(cfg.device).type == "cpu" else "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.dtype))
    model = model.to(cfg.device).eval().requires_grad_(False)  # frozen
    server = Server(cfg)
    server.set_app(make_app(model, cfg))
    print(f"ref server: serves {cfg.model} on {cfg.device} in {cfg.dtype}, listening on "
          f"http://{cfg.host}:{cfg.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(parse_flags())
