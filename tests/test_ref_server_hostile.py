"""ref_server.py (and regroup_ver/'s server) under hostile input, floods and exposure, live on loopback (no mocks).

Every malformed, slow or stalled request gets a 4xx or is closed, a crowd of connections gets 429s,
memory stays bounded and valid groups pass exactly once; a flood of valid uploads gets 503s and
loses no group; off loopback the server needs a token."""
import http.client
import json
import os
import pickle
import random
import re
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import psutil
import pytest
import requests
import torch
from safetensors.torch import save

from simple_grpo.protocol import VERSION, decode, encode, post_groups
from tests.test_regroup import upload as regroup_group
from tools.launch import MODEL, ROOT, free_port, start_ref_server

VOCAB, MAX_LEN = 561, 512  # the tiny model's
SENTINEL = "/tmp/simple_grpo_pickle_ran"


def valid_group(seed, G=4, P=9, C=7):
    g = torch.Generator().manual_seed(seed)
    tensors = {"prompt_ids": torch.randint(3, 500, (P,), generator=g),
               "completion_ids": torch.randint(3, 500, (G, C), generator=g),
               "rewards": torch.rand(G, generator=g), "advantages": torch.randn(G, generator=g),
               "sampler_logps": -torch.rand(G, C, generator=g)}
    return tensors, {"policy_version": seed, "temperature": 1.0}


class Evil:  # unpickling this would create SENTINEL
    def __reduce__(self):
        return (os.system, (f"touch {SENTINEL}",))


def hostile_bodies(rng):
    """(kind, body) pairs: each malformed in one way."""
    bodies = []
    for _ in range(300):  # random bytes
        bodies.append(("random", bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 3000)))))
    for i in range(300):  # truncated frames
        body = encode(*valid_group(i))
        bodies.append(("truncated", body[:rng.randint(0, len(body) - 1)]))
    for i in range(200):  # wrong shapes
        t, m = valid_group(i)
        name, shape = rng.choice([("completion_ids", (4 * 7,)), ("completion_ids", (1, 4, 7)), ("prompt_ids", (3, 3)),
                                  ("rewards", (5,)), ("advantages", (4, 1)), ("sampler_logps", (4, 6)),
                                  ("completion_ids", (0, 7)), ("prompt_ids", (0,))])
        t[name] = torch.zeros(shape, dtype=t[name].dtype)
        bodies.append(("shape", encode(t, m)))
    for i in range(200):  # huge declared sizes
        kind = i % 4
        if kind == 0:  # header length far past the body
            body = (2**62 + i).to_bytes(8, "little") + b"{}"
        elif kind == 1:  # a tensor whose bytes lie far past the body
            header = {"prompt_ids": {"dtype": "I64", "shape": [10**12], "data_offsets": [0, 8 * 10**12]},
                      "__metadata__": {"json": json.dumps({"version": VERSION})}}
            h = json.dumps(header).encode()
            body = len(h).to_bytes(8, "little") + h + b"\0" * 64
        elif kind == 2:  # a group of too many completions, or tokens past the model's length
            t, m = valid_group(i, G=300, C=1) if i % 8 == 2 else valid_group(i, P=400, C=200)
            body = encode(t, m)
        else:  # shape and data_offsets disagree
            header = {"rewards": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 16]},
                      "__metadata__": {"json": json.dumps({"version": VERSION})}}
            h = json.dumps(header).encode()
            body = len(h).to_bytes(8, "little") + h + b"\0" * 16
        bodies.append(("huge", body))
    for i in range(200):  # out-of-vocabulary ids
        t, m = valid_group(i)
        name = rng.choice(["prompt_ids", "completion_ids"])
        t[name].view(-1)[rng.randrange(t[name].numel())] = rng.choice([VOCAB, VOCAB + 7, 10**9, -1, -(2**40)])
        bodies.append(("vocab", encode(t, m)))
    for i in range(200):  # NaN or infinite rewards, advantages, log-probs
        t, m = valid_group(i)
        name = rng.choice(["rewards", "advantages", "sampler_logps"])
        t[name].view(-1)[0] = rng.choice([float("nan"), float("inf"), -float("inf")])
        bodies.append(("nan", encode(t, m)))
    for i in range(200):  # pickle payloads, plain and torch.save's zip
        obj = [Evil(), {"prompt_ids": [1, 2, 3]}, valid_group(i)[0], Evil()][i % 4]
        if i % 2:
            import io
            buf = io.BytesIO()
            torch.save(obj, buf)
            bodies.append(("pickle", buf.getvalue()))
        else:
            bodies.append(("pickle", pickle.dumps(obj, protocol=rng.choice([2, 4, 5]))))
    for i in range(150):  # wrong dtypes
        t, m = valid_group(i)
        name, dtype = rng.choice([("prompt_ids", torch.int32), ("completion_ids", torch.float32),
                                  ("completion_ids", torch.bool), ("rewards", torch.int64),
                                  ("advantages", torch.float16), ("sampler_logps", torch.int8)])
        t[name] = t[name].to(dtype)
        bodies.append(("dtype", encode(t, m)))
    for i in range(150):  # missing or unexpected tensors
        t, m = valid_group(i)
        if i % 2:
            del t[rng.choice(["prompt_ids", "completion_ids"])]  # rewards, advantages, sampler_logps are optional
        else:
            t["weights"] = torch.zeros(3)
        bodies.append(("fields", encode(t, m)))
    for i in range(150):  # bad metadata
        t, m = valid_group(i)
        bad = [{"version": VERSION + 1}, {"version": None}, {"temperature": 0}, {"temperature": -1.0},
               {"temperature": "hot"}, {"temperature": float("nan")}, {"policy_version": "3"},
               {"policy_version": 1.5}, {"policy_version": True}][i % 9]
        if "version" in bad:
            meta_json = json.dumps({**m, **bad})
            body = save({k: v.contiguous() for k, v in t.items()}, metadata={"json": meta_json})
        else:
            body = encode(t, {**m, **bad})
        bodies.append(("meta", body))
    for i in range(20):  # metadata that is not a JSON dict
        body = save({"prompt_ids": torch.ones(3, dtype=torch.long)}, metadata={"json": ["[1, 2]", "nope", "1"][i % 3]})
        bodies.append(("meta", body))
    return bodies


# ---------------------------------------------------------------- requests broken below the body
CUT_S = 3  # the servers' --conn_timeout in these tests: a connection is cut this long after it opened
SLOTS = 32  # their --max_connections


def exchange(port, chunks, pause=0.0, hang=False):
    """Send chunks on a new connection (pause s between them), then stop sending (or, with hang, keep
    the connection open) and read the answer: its HTTP status, "closed" if the server closed without
    one, or "open" if it still held the connection well past CUT_S."""
    s = socket.create_connection(("127.0.0.1", port), timeout=CUT_S + 10)
    data = b""
    try:
        try:
            for chunk in chunks:
                s.sendall(chunk)
                time.sleep(pause)
            if not hang:
                s.shutdown(socket.SHUT_WR)
        except OSError:  # the server closed first: cut off, or refused at once
            pass
        try:
            while part := s.recv(65536):
                data += part
        except TimeoutError:
            return "open"
        except OSError:
            pass  # reset: closed
    finally:
        s.close()
    return answer_of(data)


def answer_of(data):
    """What the server sent back: its HTTP status, "closed" for nothing, "garbled" for no status line."""
    statuses = re.findall(rb"^HTTP/1\.[01] (\d{3})", data, re.M)
    statuses = [int(code) for code in statuses if code != b"100"]  # after "100 Continue" comes the answer
    return statuses[0] if statuses else ("closed" if not data else "garbled")


def request(head, body=b"", method="POST", path="/upload", version="HTTP/1.1"):
    return f"{method} {path} {version}\r\n".encode() + head + b"\r\n" + body


def malformed_requests(rng, n):
    """n raw requests, each broken in its request line, headers, length or body; the sender stops
    sending after each (so a short body ends rather than stalls)."""
    valid = encode(*valid_group(7))
    length = f"Content-Length: {len(valid)}\r\n".encode()
    makers = [
        lambda: [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300))) + b"\r\n\r\n"],  # garbage
        lambda: [b"POST /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n"],  # request line too long (414)
        lambda: [request(b"X-Big: " + b"b" * 70000 + b"\r\n")],  # header line too long (431)
        lambda: [request(b"".join(b"X-%d: 1\r\n" % i for i in range(rng.randint(101, 400))))],  # too many
        lambda: [request(b"", version=rng.choice(["HTTP/2.0", "HTTP/9.9", "HTTP/1", "HTTX/1.1", "HTTP/1.1.1",
                                                    "HTTP/11111111111.1", "HTTP/-1.1"]))],
        lambda: [rng.choice([b"POST\r\n\r\n", b"POST /upload\r\n\r\n", b"\r\n\r\n",
                             b"POST /upload HTTP/1.1 extra\r\n\r\n", b"\x00\x01\x02 / HTTP/1.1\r\n\r\n"])],
        lambda: [request(b"Content-Length: " + rng.choice([b"abc", b"-1", b"1e3", b"+5", b"0x10", b"", b"99" * 30,
                                                          b"\xff\xfe"]) + b"\r\n", valid)],
        lambda: [request(f"Content-Length: {len(valid)}\r\nContent-Length: 3\r\n".encode(), valid)],
        lambda: [request(length, valid[:rng.randrange(len(valid))])],  # truncated body: ends early
        lambda: [request(f"Content-Length: {rng.randrange(1, len(valid))}\r\n".encode(), valid)],  # too short
        lambda: [request(b"Transfer-Encoding: chunked\r\n", b"zz\r\n" + valid)],  # chunked, no length (411)
        lambda: [request(length + b"Transfer-Encoding: chunked\r\n", b"zz\r\n" + valid)],  # broken chunks
        lambda: [request(length + b"Expect: 100-continue\r\n"), valid[:50]],  # waits for 100, then short
        lambda: [request(b"Authorization: Bearer " + b"t" * 60000 + b"\r\n" + length, valid[:-1])],
        lambda: [request(b"Content-Type: multipart/form-data; boundary=x\r\n" + length, valid[::-1])],
        lambda: [request(length, valid, method=rng.choice(["PUT", "DELETE", "PATCH", "OPTIONS", "FOO"]))],
        lambda: [request(b"", method="GET", path=rng.choice(["/../../etc/passwd", "/get?wait=abc", "/get?wait=nan",
                                                             "/%00", "/upload", "/get?wait=1&wait=x"]))],
        lambda: [],  # connect, then hang up at once
    ]
    return [rng.choice(makers)() for _ in range(n)]


def stalled_requests(rng, n):
    """n requests that never finish: slow senders (a byte at a time, for far longer than CUT_S),
    bodies shorter than their Content-Length on a connection kept open, and connections that send
    nothing. The server must cut each at CUT_S. (chunks, pause) pairs, sent with hang=True."""
    head = request(b"Content-Length: 500\r\n")
    makers = [lambda: ([bytes([b]) for b in head] + [b"x"] * 100, 0.1),  # slow sender: 0.1 s a byte
              lambda: ([head + b"\0" * rng.randrange(499)], 0.0),  # short body, connection kept open
              lambda: ([head[:rng.randrange(len(head))]], 0.0),  # stops inside its headers
              lambda: ([], 0.0)]  # silent
    return [rng.choice(makers)() for _ in range(n)]


class RssWatch:
    """The server's largest RSS, sampled every 0.1 s while the attack runs."""

    def __init__(self, pid):
        self.proc, self.peak, self.stop = psutil.Process(pid), 0, threading.Event()
        self.start = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()

    def watch(self):
        while not self.stop.wait(0.1):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def growth_mb(self):
        self.stop.set()
        self.thread.join()
        return (max(self.peak, self.proc.memory_info().rss) - self.start) / 2**20


# each server's valid upload (a group it serves), and its check that the group came back intact
def plain_upload(version):
    return valid_group(version)


def regroup_upload(version):
    return regroup_group(question=11, rewards=[0.5, 1.5, 0.5, 1.5], version=version, answer_id=100 * version)


SERVERS = {"ref_server.py": ([], plain_upload, "groups_in"),
           "regroup_ver/ref_server_regroup.py": (["--num_generations", "4"], regroup_upload, "groups_formed")}


def attack(script, body_rounds, n_malformed, n_stalled, n_crowd):
    """Start `script` and send it hostile requests between two valid uploads. Every hostile one must
    get a 4xx or be closed; RSS must stay bounded; both valid groups come out once, in order."""
    extra, make_upload, formed = SERVERS[script]
    port = free_port()
    proc = start_ref_server(port, dict(os.environ), "--max_body_mb", "1", "--max_connections", str(SLOTS),
                            "--conn_timeout", str(CUT_S), *extra, script=script)
    url, outcomes, rng = f"http://127.0.0.1:{port}", Counter(), random.Random(0)
    try:
        requests.post(url + "/upload", data=encode(*make_upload(1)), timeout=30).raise_for_status()
        rss = RssWatch(proc.pid)
        t0 = time.time()
        # 1. malformed bodies under well-formed headers, one after another
        with requests.Session() as session:
            for round_ in range(body_rounds):
                for kind, body in hostile_bodies(random.Random(round_)):
                    r = session.post(url + "/upload", data=body, timeout=30)
                    assert 400 <= r.status_code < 500 and r.json()["error"], (kind, r.status_code, r.text[:200])
                    outcomes[r.status_code] += 1
            for size in (2 * 2**20, 10**12):  # past --max_body_mb, declared: refused before it is read
                outcomes[exchange(port, [request(f"Content-Length: {size}\r\n".encode(), b"\0" * 1024)])] += 1
        # 2. broken request lines, headers, lengths and bodies, 16 connections at a time
        with ThreadPoolExecutor(16) as pool:
            outcomes.update(pool.map(lambda chunks: exchange(port, chunks), malformed_requests(rng, n_malformed)))
        # 3. slow and stalled senders, more at once than the server has slots
        with ThreadPoolExecutor(2 * SLOTS) as pool:
            outcomes.update(pool.map(lambda c: exchange(port, c[0], pause=c[1], hang=True),
                                     stalled_requests(rng, n_stalled)))
        # 4. a crowd: n_crowd connections opened at once, each stopping inside its headers
        crowd = [socket.create_connection(("127.0.0.1", port), timeout=CUT_S + 10) for _ in range(n_crowd)]
        for s in crowd:
            s.sendall(b"POST /upload HTTP/1.1\r\nContent-Le")
        outcomes.update(read_until_closed(crowd))
        seconds, growth = time.time() - t0, rss.growth_mb()

        sent = sum(outcomes.values())
        print(f"{script}: {sent} hostile requests in {seconds:.0f} s, server RSS +{growth:.1f} MB, "
              f"outcomes {dict(sorted(outcomes.items(), key=str))}")
        assert sent == body_rounds * len(hostile_bodies(random.Random(0))) + 2 + n_malformed + n_stalled + n_crowd
        assert all(o == "closed" or 400 <= o < 500 for o in outcomes), outcomes
        assert outcomes[429] > 0 and outcomes["closed"] > 0  # the slots filled, and stalled senders were cut
        assert growth < 200, f"server RSS grew {growth:.0f} MB"
        assert not os.path.exists(SENTINEL), "a pickle payload was unpickled"

        # the valid groups, one before the attack and one after, each come out once, in order
        requests.post(url + "/upload", data=encode(*make_upload(2)), timeout=30).raise_for_status()
        versions = []
        for _ in range(2):
            r = requests.get(url + "/get", params={"wait": 10, "policy_version": 2}, timeout=30)
            assert r.status_code == 200
            tensors, meta = decode(r.content)
            versions.append(meta["policy_version"])
            assert torch.isfinite(tensors["ref_logps"]).all()
            assert tensors["ref_logps"].shape == tensors["completion_ids"].shape
        assert versions == [1, 2]
        assert requests.get(url + "/get", params={"wait": 1}, timeout=30).status_code == 204
        stats = requests.get(url + "/stats", timeout=5).json()
        assert stats[formed] == 2 and stats["groups_taken"] == 2 and stats["errors"] == 0
        assert stats["rejected"] >= body_rounds * 2000
        return sent
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def read_until_closed(socks):
    """Each socket's answer (as exchange reads it) once the server closes it; "open" for any still
    open CUT_S + 10 s on."""
    answers, data = [], {s: b"" for s in socks}
    deadline = time.time() + CUT_S + 10
    with selectors.DefaultSelector() as sel:
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        while data and time.time() < deadline:
            for key, _ in sel.select(timeout=1):
                s = key.fileobj
                try:
                    part = s.recv(65536)
                except OSError:
                    part = b""
                data[s] += part
                if not part:
                    sel.unregister(s)
                    s.close()
                    answers.append(answer_of(data.pop(s)))
    answers += ["open"] * len(data)
    for s in data:
        s.close()
    return answers


# the regroup server shares the HTTP layer (simple_grpo/http_server.py) the first attack tests; attacked
# whole it takes ~25 s of the fast suite: slow-marked (make test-all)
@pytest.mark.parametrize("script", ["ref_server.py", pytest.param("regroup_ver/ref_server_regroup.py",
                                                                  marks=pytest.mark.slow)])
def test_ten_thousand_hostile_requests_get_4xx_or_are_closed_and_valid_groups_pass_once(script):
    assert attack(script, body_rounds=3, n_malformed=2500, n_stalled=640, n_crowd=800) >= 10000


def test_a_trainer_waits_out_a_429_when_every_connection_is_taken():
    port = free_port()
    proc = start_ref_server(port, dict(os.environ), "--max_connections", "1", "--conn_timeout", "2")
    try:
        hog = socket.create_connection(("127.0.0.1", port))  # a stalled sender holds the one slot for 2 s
        hog.sendall(b"POST /upload HTTP/1.1\r\n")
        time.sleep(0.3)
        assert requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 429
        cfg = SimpleNamespace(ref_url=f"http://127.0.0.1:{port}", ref_token="", peer_timeout=30, ref_timeout=30)
        post_groups(cfg, [valid_group(5)])  # retried until the stalled sender is cut
        hog.close()
        # the upload's own connection may still hold the one slot for a moment after its answer: wait it out too
        deadline = time.time() + 10
        while (stats := requests.get(f"http://127.0.0.1:{port}/stats", timeout=5)).status_code == 429:
            assert time.time() < deadline, "the one connection slot was not freed within 10 s"
            time.sleep(0.1)
        assert stats.json()["groups_in"] == 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_over_the_limits_a_body_gets_413_and_no_length_411():
    port = free_port()
    proc = start_ref_server(port, dict(os.environ), "--max_body_mb", "1")
    try:
        for size in (2 * 2**20, 10**12):  # past --max_body_mb: refused before it is read
            conn = http.client.HTTPConnection(f"127.0.0.1:{port}", timeout=30)
            conn.putrequest("POST", "/upload")
            conn.putheader("Content-Length", str(size))
            conn.endheaders()
            conn.send(b"\0" * 1024)
            assert conn.getresponse().status == 413
            conn.close()
        r = requests.post(f"http://127.0.0.1:{port}/upload", data=iter([b"\0" * 100]), timeout=30)  # chunked
        assert r.status_code == 411
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_flood_gets_503s_and_loses_or_duplicates_no_group():
    port = free_port()
    proc = start_ref_server(port, dict(os.environ), "--max_queue", "4", "--max_queue_mb", "1")
    url, n = f"http://127.0.0.1:{port}", 150
    try:
        rss_start = psutil.Process(proc.pid).memory_info().rss
        sent, refused_full, rss_max = [], [0], [rss_start]

        def produce():  # uploads as fast as it can; on 503 it backs off briefly and retries
            with requests.Session() as s:
                for i in range(n):
                    body = encode(*valid_group(i, G=8, C=48))
                    while (r := s.post(url + "/upload", data=body, timeout=30)).status_code == 503:
                        refused_full[0] += 1
                        time.sleep(0.002)
                    assert r.status_code == 200
                    sent.append(i)

        producer = threading.Thread(target=produce)
        producer.start()
        taken = []
        with requests.Session() as s:
            while len(taken) < n:
                r = s.get(url + "/get", params={"wait": 10}, timeout=30)
                assert r.status_code == 200
                taken.append(decode(r.content)[1]["policy_version"])
                rss_max[0] = max(rss_max[0], psutil.Process(proc.pid).memory_info().rss)
                time.sleep(0.02)  # the trainer is slower than the producer
        producer.join(timeout=60)
        assert refused_full[0] > 0  # the queue filled and said so
        assert taken == sent == list(range(n))  # FIFO, nothing lost, nothing twice
        assert requests.get(url + "/get", timeout=5).status_code == 204
        assert rss_max[0] - rss_start < 200 * 2**20
        stats = requests.get(url + "/stats", timeout=5).json()
        assert stats["rejected_full"] == refused_full[0] and stats["groups_taken"] == n
        assert stats["queued_bytes"] == 0
        print(f"flood: {n} groups, {refused_full[0]} answered 503, server RSS +{(rss_max[0] - rss_start) / 2**20:.1f} MB")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_off_loopback_the_server_refuses_to_start_without_a_token():
    env = {k: v for k, v in os.environ.items() if k != "SIMPLE_GRPO_TOKEN"}
    out = subprocess.run([sys.executable, "ref_server.py", "--model", MODEL, "--host", "0.0.0.0",
                          "--port", str(free_port())], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "without a token" in out.stderr


def test_with_a_token_requests_without_it_get_401():
    port = free_port()
    proc = start_ref_server(port, dict(os.environ), "--host", "0.0.0.0", "--token", "s3cret", token="s3cret")
    url = f"http://127.0.0.1:{port}"
    try:
        body = encode(*valid_group(1))
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            assert requests.get(url + "/health", headers=headers, timeout=5).status_code == 401
            assert requests.get(url + "/get", headers=headers, timeout=5).status_code == 401
            assert requests.post(url + "/upload", data=body, headers=headers, timeout=5).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert requests.post(url + "/upload", data=body, headers=ok, timeout=5).status_code == 200
        assert requests.get(url + "/get", params={"wait": 10}, headers=ok, timeout=30).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
