"""ref_server.py, live on loopback: reference log-probs equal a transformers forward and grpo_math.completion_logps;
/get is FIFO."""
import os

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from grpo_math import completion_logps
from simple_grpo.protocol import decode, encode
from tools.launch import free_port, start_ref_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "tiny-math")


@pytest.fixture(scope="module")
def server(shared_ref_server):
    """The live ref server other modules' runs use (conftest's, one for the session)."""
    return shared_ref_server


@pytest.fixture(scope="module")
def own_server():
    """A ref server of this module's own: the checks below see an empty queue (FIFO, 204), whatever ran before."""
    port = free_port()
    proc = start_ref_server(port, dict(os.environ))  # the demo's own start-up: waits for /health
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=30)


def group(seed, G=4, P=9, C=7):
    g = torch.Generator().manual_seed(seed)
    tensors = {"prompt_ids": torch.randint(3, 500, (P,), generator=g),
               "completion_ids": torch.randint(3, 500, (G, C), generator=g),
               "rewards": torch.rand(G, generator=g), "advantages": torch.randn(G, generator=g)}
    return tensors, {"policy_version": seed, "temperature": 1.0}


def take(url):
    r = requests.get(url + "/get", params={"wait": 10}, timeout=30)
    assert r.status_code == 200
    return decode(r.content)


def test_health_and_stats_answer_json(own_server):
    assert requests.get(own_server + "/health", timeout=5).json()["status"] == "ok"
    stats = requests.get(own_server + "/stats", timeout=5).json()
    for key in ("waiting", "ready", "groups_in", "groups_out", "groups_taken", "rejected", "rejected_full",
                "errors", "queued_bytes", "uptime_s"):
        assert key in stats, key


def test_ref_logps_equal_a_direct_transformers_forward(own_server):
    tensors, meta = group(1)
    assert requests.post(own_server + "/upload", data=encode(tensors, meta), timeout=30).status_code == 200
    back, back_meta = take(own_server)
    assert back_meta["policy_version"] == 1
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    P = tensors["prompt_ids"].numel()
    ids = torch.cat([tensors["prompt_ids"].expand(4, -1), tensors["completion_ids"]], 1)
    with torch.no_grad():
        logits = model(ids).logits[:, P - 1:-1]
    expected = logits.log_softmax(-1).gather(-1, tensors["completion_ids"][..., None])[..., 0]
    assert back["ref_logps"].shape == (4, 7)
    assert torch.allclose(back["ref_logps"], expected, atol=1e-5)
    assert torch.equal(back["completion_ids"], tensors["completion_ids"])


def test_ref_logps_equal_grpo_math_completion_logps_of_the_reference_model(own_server):
    """What grpo_train.py's `# GRPO 3.` takes from the server, for an upload of the tokens alone: the
    log-probs grpo_math.completion_logps gives for the frozen reference model in evaluation mode, at the
    sampling temperature (the server runs simple_grpo/logprobs.py's sequence_logps: the prompt once)."""
    g = torch.Generator().manual_seed(7)
    tokens = {"prompt_ids": torch.randint(3, 500, (9,), generator=g),
              "completion_ids": torch.randint(3, 500, (4, 7), generator=g)}
    r = requests.post(own_server + "/upload", data=encode(tokens, {"policy_version": 0, "temperature": 0.7}),
                      timeout=30)
    assert r.status_code == 200
    back, _ = take(own_server)
    reference = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        expected, _ = completion_logps(reference, tokens["prompt_ids"][None], torch.ones(1, 9, dtype=torch.long),
                                       tokens["completion_ids"], temperature=0.7)  # (4, 7)
    assert torch.equal(back["completion_ids"], tokens["completion_ids"]) and set(back) == {*tokens, "ref_logps"}
    assert torch.allclose(back["ref_logps"], expected, atol=1e-5)


def test_get_is_first_in_first_out(own_server):
    for seed in range(10, 16):
        requests.post(own_server + "/upload", data=encode(*group(seed)), timeout=30).raise_for_status()
    assert [take(own_server)[1]["policy_version"] for _ in range(6)] == list(range(10, 16))


def test_get_with_nothing_ready_answers_204(own_server):
    assert requests.get(own_server + "/get", timeout=5).status_code == 204


def test_bad_upload_gets_400_with_a_reason(own_server):
    tensors, meta = group(2)
    tensors["completion_ids"][0, 0] = 10**6  # outside the vocabulary
    r = requests.post(own_server + "/upload", data=encode(tensors, meta), timeout=30)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]
    r = requests.post(own_server + "/upload", data=b"\x80\x04pickle?", timeout=30)
    assert r.status_code == 400
