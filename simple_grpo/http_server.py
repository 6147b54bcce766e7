"""regroup_ver/'s reference server's HTTP side (ref_server.py, a lesson file, holds its own copy): a shared token,
/health, checked uploads, bounded connections. Each refusal is a 4xx with a one-line JSON reason."""
import hmac
import ipaddress
import json
import math
import os
import socket
import sys
import threading
import time
from http import HTTPStatus
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import bottle

from simple_grpo.devices import physical_gpu
from simple_grpo.protocol import TOKEN_ENV, check_rollout, decode, model_fingerprint


def answer(status, reason):
    """An error response: HTTP status and a one-line JSON reason."""
    return bottle.HTTPResponse(json.dumps({"error": reason}), status=status, content_type="application/json")


def add_token_check_and_health(app, cfg, stats):
    """With cfg.token set, a request without 'Authorization: Bearer TOKEN' gets 401; GET /health says what is served."""
    started = time.time()
    about = {"model": cfg.model, "fingerprint": model_fingerprint(cfg.model), "device": cfg.device,
             "dtype": cfg.dtype, "gpu": physical_gpu(cfg.device)}

    @app.get("/health")
    def health():
        return {"status": "ok", **about, "uptime_s": round(time.time() - started, 1)}

    @app.hook("before_request")
    def check_token():
        sent = bottle.request.get_header("Authorization", "")
        if cfg.token and not hmac.compare_digest(sent.encode(), f"Bearer {cfg.token}".encode()):
            stats["rejected"] += 1
            raise answer(401, "missing or wrong token (send 'Authorization: Bearer TOKEN')")


def read_rollout(cfg, model_config, stats):
    """The uploaded group as (body size, tensors, meta), checked (its declared size before it is read), or a 4xx."""
    limit = cfg.max_body_mb * 2**20
    try:
        size = bottle.request.content_length  # -1: none declared
        if not 0 <= size <= limit:
            status, reason = (411, "Content-Length required") if size < 0 else \
                             (413, f"body of {size} bytes > {cfg.max_body_mb} MB")
        else:
            tensors, meta = decode(bottle.request.body.read(limit))
            check_rollout(tensors, meta, model_config.vocab_size, model_config.max_position_embeddings,
                          cfg.max_group_size)
            return size, tensors, meta
    except ValueError as e:  # a Content-Length that is no number too
        status, reason = 400, str(e)
    except (OSError, bottle.HTTPError) as e:  # the sender hung up mid-body, or sent broken chunks
        status, reason = 400, f"the body could not be read ({type(e).__name__})"
    stats["rejected"] += 1
    raise answer(status, reason)


def wait_seconds():
    """/get's ?wait=: how long to wait for a finished group (0 to 30 s)."""
    try:
        wait = float(bottle.request.query.get("wait") or 0)
        if math.isnan(wait):
            raise ValueError
    except ValueError:
        raise answer(400, "wait must be a number of seconds") from None
    return min(max(wait, 0.0), 30.0)


class ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most max_connections (more get 429), each cut off after conn_timeout seconds."""
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


def check_exposure(cfg):
    """The token (--token, else $SIMPLE_GRPO_TOKEN), needed for an address off loopback."""
    cfg.token = cfg.token or os.environ.get(TOKEN_ENV, "")
    try:
        loopback = cfg.host == "localhost" or ipaddress.ip_address(cfg.host).is_loopback
    except ValueError:  # a host name
        loopback = False
    if not loopback and not cfg.token:
        raise SystemExit(f"refusing to listen on {cfg.host} without a token: anyone who reaches it could feed "
                         f"the trainer. Set --token or {TOKEN_ENV} (trainers pass it as --ref_token).")


def serve(app, cfg, name="ref server"):
    server = ThreadingWSGIServer((cfg.host, cfg.port), QuietHandler, cfg.max_connections, cfg.conn_timeout)
    server.set_app(app)
    print(f"{name}: serves {cfg.model} on {cfg.device} in {cfg.dtype}, listening on http://{cfg.host}:{cfg.port}",
          flush=True)
    server.serve_forever()
