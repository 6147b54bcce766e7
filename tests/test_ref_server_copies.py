"""ref_server.py is a lesson file, whole in itself: it imports nothing from simple_grpo/ and copies what it needs
(CleanRL's rule). These tests hold its copies equal to the package's, which the full trainer and regroup_ver/
use: the message format (VERSION, encode and decode both ways), the same refusals of malformed messages and
groups (check_rollout), the model fingerprint /health reports (the trainer's check_reference compares it with
protocol.model_fingerprint of its own model), and the flags (protocol.ServerConfig's names and defaults)."""
import ast
import dataclasses
import os
import random

import pytest
import torch

import ref_server
from simple_grpo import protocol
from simple_grpo.flags import parse_flags
from tests.test_ref_server_hostile import MAX_LEN, SENTINEL, VOCAB, hostile_bodies, valid_group
from tools.fetch_smollm2 import is_complete, model_dir
from tools.launch import ROOT

TINY = os.path.join(ROOT, "models", "tiny-math")


def test_it_imports_from_the_project_only_grpo_math():
    tree = ast.parse(open(os.path.join(ROOT, "ref_server.py"), encoding="utf-8").read())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    project = {name[:-3] if name.endswith(".py") else name for name in os.listdir(ROOT)}
    assert {module.split(".")[0] for module in modules} & project == {"grpo_math"}


def test_the_message_version_token_variable_and_optional_tensors_are_the_packages():
    assert ref_server.VERSION == protocol.VERSION == 2
    assert ref_server.TOKEN_ENV == protocol.TOKEN_ENV
    assert ref_server.FLOAT_TENSORS == protocol.FLOAT_TENSORS


@pytest.mark.parametrize("encode, decode", [(ref_server.encode, protocol.decode), (protocol.encode, ref_server.decode)],
                         ids=["ref_server_to_package", "package_to_ref_server"])
def test_a_message_encoded_by_one_decodes_with_the_other(encode, decode):
    tensors, meta = valid_group(3)
    tensors["ref_logps"] = -torch.rand(4, 7)
    meta = {**meta, "run_id": "run-1", "temperature": 0.7}
    got, got_meta = decode(encode(tensors, meta))
    assert got_meta == {"version": protocol.VERSION, **meta}
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_both_encode_a_group_to_the_same_bytes():
    tensors, meta = valid_group(5)
    assert ref_server.encode(tensors, meta) == protocol.encode(tensors, meta)


def verdict(module, body, max_group_size=256):
    """How module's decode and check_rollout take body: 'decode refused', 'check refused' or 'accepted'."""
    try:
        tensors, meta = module.decode(body)
    except ValueError:
        return "decode refused"
    try:
        module.check_rollout(tensors, meta, VOCAB, MAX_LEN, max_group_size)
    except ValueError:
        return "check refused"
    return "accepted"


def test_decode_and_check_rollout_refuse_the_same_malformed_messages_and_groups():
    """The hostile test's ~2,000 bodies (random bytes, truncated frames, wrong shapes, dtypes, fields, sizes, ids,
    NaNs, pickles, bad metadata), each refused by both at the same stage; valid groups accepted by both."""
    bodies = hostile_bodies(random.Random(0))
    for kind, body in bodies:
        ours, theirs = verdict(ref_server, body), verdict(protocol, body)
        assert ours == theirs != "accepted", (kind, ours, theirs)
    stages = {verdict(ref_server, body) for _, body in bodies}
    assert stages == {"decode refused", "check refused"}  # both stages were tried
    for seed in range(20):
        body = protocol.encode(*valid_group(seed, G=1 + seed % 8, C=1 + seed))
        assert verdict(ref_server, body) == verdict(protocol, body) == "accepted"
    body = protocol.encode(*valid_group(1, G=9))  # --max_group_size 8
    assert verdict(ref_server, body, 8) == verdict(protocol, body, 8) == "check refused"
    assert not os.path.exists(SENTINEL), "a pickle payload was unpickled"


@pytest.mark.parametrize("meta", [{"temperature": True}, {"temperature": 1e309}, {"temperature": 2},
                                  {"policy_version": False}, {"policy_version": 2**40}, {"run_id": None}])
def test_check_rollout_takes_the_same_metadata(meta):
    tensors, base = valid_group(2)
    results = []
    for module in (ref_server, protocol):
        try:
            module.check_rollout(tensors, {**base, **meta}, VOCAB, MAX_LEN, 256)
            results.append("accepted")
        except ValueError:
            results.append("refused")
    assert results[0] == results[1], meta


@pytest.mark.parametrize("which", ["tiny-math", "SmolLM2-135M-Instruct"])
def test_the_fingerprint_is_the_packages(which):
    """What /health reports is what the trainer's check_reference computes for its own --model."""
    path = TINY if which == "tiny-math" else model_dir()
    if not is_complete(path):
        pytest.skip(f"{which} is not at {path}: `python tools/fetch_smollm2.py` converts it there "
                    "(or set SIMPLE_GRPO_SMOLLM2 to a converted copy)")
    ours = ref_server.model_fingerprint(path)
    assert ours == protocol.model_fingerprint(path)
    assert ours["weights"] and ours["config"]  # there was something to compare


def test_the_flags_are_the_package_server_configs_names_types_and_defaults():
    ours, theirs = dataclasses.fields(ref_server.Config), dataclasses.fields(protocol.ServerConfig)
    assert [(f.name, f.type, f.default) for f in ours] == [(f.name, f.type, f.default) for f in theirs]
    assert ref_server.parse_flags([]) == ref_server.Config()
    args = ["--model", TINY, "--port", "123", "--conn_timeout", "2.5", "--threads", "2", "--dtype", "bfloat16",
            "--host", "0.0.0.0", "--token", "t", "--max_queue_mb", "3"]
    assert dataclasses.asdict(ref_server.parse_flags(args)) == \
        dataclasses.asdict(parse_flags(protocol.ServerConfig, args=args))
