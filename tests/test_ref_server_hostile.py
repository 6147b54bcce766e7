"""ref_server.py under hostile input, floods and exposure, live on loopback (no mocks).

Every malformed upload gets a 4xx and the server goes on; a flood gets 503s, memory stays
bounded and no group is lost or duplicated; off loopback it needs a token."""
import http.client
import json
import os
import pickle
import random
import subprocess
import sys
import threading
import time

import psutil
import pytest
import requests
import torch
from safetensors.torch import save

from protocol import decode, encode
from tools.demo import MODEL, ROOT, free_port, start_ref_server

VOCAB, MAX_LEN = 561, 512  # the tiny model's
SENTINEL = "/tmp/simple_grpo_pickle_ran"


def valid_group(seed, G=4, P=9, C=7):
    g = torch.Generator().manual_seed(seed)
    tensors = {"prompt_ids": torch.randint(3, 500, (P,), generator=g),
               "completion_ids": torch.randint(3, 500, (G, C), generator=g),
               "rewards": torch.rand(G, generator=g), "advantages": torch.randn(G, generator=g),
               "old_logps": -torch.rand(G, C, generator=g)}
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
                                  ("rewards", (5,)), ("advantages", (4, 1)), ("old_logps", (4, 6)),
                                  ("completion_ids", (0, 7)), ("prompt_ids", (0,))])
        t[name] = torch.zeros(shape, dtype=t[name].dtype)
        bodies.append(("shape", encode(t, m)))
    for i in range(200):  # huge declared sizes
        kind = i % 4
        if kind == 0:  # header length far past the body
            body = (2**62 + i).to_bytes(8, "little") + b"{}"
        elif kind == 1:  # a tensor whose bytes lie far past the body
            header = {"prompt_ids": {"dtype": "I64", "shape": [10**12], "data_offsets": [0, 8 * 10**12]},
                      "__metadata__": {"json": json.dumps({"version": 1})}}
            h = json.dumps(header).encode()
            body = len(h).to_bytes(8, "little") + h + b"\0" * 64
        elif kind == 2:  # a group of too many completions, or tokens past the model's length
            t, m = valid_group(i, G=300, C=1) if i % 8 == 2 else valid_group(i, P=400, C=200)
            body = encode(t, m)
        else:  # shape and data_offsets disagree
            header = {"rewards": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 16]},
                      "__metadata__": {"json": json.dumps({"version": 1})}}
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
        name = rng.choice(["rewards", "advantages", "old_logps"])
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
                                  ("advantages", torch.float16), ("old_logps", torch.int8)])
        t[name] = t[name].to(dtype)
        bodies.append(("dtype", encode(t, m)))
    for i in range(150):  # missing or unexpected tensors
        t, m = valid_group(i)
        if i % 2:
            del t[rng.choice(["prompt_ids", "completion_ids", "rewards", "advantages"])]
        else:
            t["weights"] = torch.zeros(3)
        bodies.append(("fields", encode(t, m)))
    for i in range(150):  # bad metadata
        t, m = valid_group(i)
        bad = [{"version": 2}, {"version": None}, {"temperature": 0}, {"temperature": -1.0},
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


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = start_ref_server(port, dict(os.environ), "--max_body_mb", "1")
    yield f"http://127.0.0.1:{port}", proc
    proc.terminate()
    proc.wait(timeout=30)


def take(url):
    r = requests.get(url + "/get", params={"wait": 10}, timeout=30)
    assert r.status_code == 200
    return decode(r.content)


def test_two_thousand_hostile_uploads_get_4xx_and_a_valid_one_still_works(server):
    url, proc = server
    tensors, meta = valid_group(12345)
    requests.post(url + "/upload", data=encode(tensors, meta), timeout=30).raise_for_status()
    expected = take(url)[0]["ref_logps"]
    rss_start = psutil.Process(proc.pid).memory_info().rss

    bodies = hostile_bodies(random.Random(0))
    assert len(bodies) >= 2000
    session, statuses = requests.Session(), {}
    for kind, body in bodies:
        r = session.post(url + "/upload", data=body, timeout=30)
        assert 400 <= r.status_code < 500, (kind, r.status_code, r.text[:200])
        assert r.json()["error"]  # a one-line reason
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    # bodies past --max_body_mb (1 MB), declared or sent: refused before they are read
    for size in (2 * 2**20, 10**12):
        conn = http.client.HTTPConnection(url.split("//")[1], timeout=30)
        conn.putrequest("POST", "/upload")
        conn.putheader("Content-Length", str(size))
        conn.endheaders()
        conn.send(b"\0" * 1024)
        assert conn.getresponse().status == 413
        conn.close()
    r = session.post(url + "/upload", data=iter([b"\0" * 100]), timeout=30)  # chunked: no length
    assert r.status_code == 411

    assert not os.path.exists(SENTINEL), "a pickle payload was unpickled"
    stats = session.get(url + "/stats", timeout=5).json()
    assert stats["rejected"] >= len(bodies) + 3 and stats["groups_in"] == 1 and stats["errors"] == 0
    assert psutil.Process(proc.pid).memory_info().rss - rss_start < 200 * 2**20
    print(f"hostile uploads: {len(bodies) + 3}, statuses {statuses}, "
          f"server RSS +{(psutil.Process(proc.pid).memory_info().rss - rss_start) / 2**20:.1f} MB")

    # a valid upload afterwards is processed, and gives the same log-probs as before
    requests.post(url + "/upload", data=encode(tensors, meta), timeout=30).raise_for_status()
    back, back_meta = take(url)
    assert back_meta["policy_version"] == 12345
    assert torch.equal(back["ref_logps"], expected) and torch.equal(back["completion_ids"], tensors["completion_ids"])


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
