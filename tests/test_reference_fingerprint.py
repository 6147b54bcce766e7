"""The reference server's defaults and its fingerprint: on a CPU it serves in fp32 (on a GPU in bf16), and a
trainer refuses a server whose model is not its own (another checkpoint, another vocabulary, another token table
or config with the same weights, weights that cannot be fingerprinted), naming both and what differs, unless
--ref_model_differs_ok. Live servers on loopback; the other models are made from models/tiny-math."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import requests
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from simple_grpo.train import Config
from simple_grpo.devices import auto_device, auto_dtype
from simple_grpo.protocol import check_reference, differences, model_fingerprint
from simple_grpo.run.checkpoints import runs_root
from tools.launch import ROOT, free_port, start_ref_server, stop

TINY = os.path.join(ROOT, "models", "tiny-math")


def test_device_and_dtype_auto_take_the_gpu_in_bf16_where_there_is_one_else_the_cpu_in_fp32():
    assert auto_device("auto", cuda_available=True) == "cuda"
    assert auto_device("auto", cuda_available=False) == "cpu"
    assert auto_device("cuda:1", cuda_available=False) == "cuda:1"  # what the user names is kept
    assert auto_dtype("auto", "cuda") == auto_dtype("auto", "cuda:3") == "bfloat16"
    assert auto_dtype("auto", "cpu") == "float32"
    assert auto_dtype("float32", "cuda") == "float32"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"perturbed": the tiny model with noise on its first layer's weights, "bf16": the tiny model saved in
    bfloat16, "bigger_vocab": the tiny model with one more token}: directories."""
    root, made = tmp_path_factory.mktemp("models"), {}
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    for name in ("perturbed", "bf16", "bigger_vocab"):
        model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(TINY)
        if name == "perturbed":
            with torch.no_grad():
                weight = model.model.layers[0].self_attn.q_proj.weight
                weight.add_(0.01 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
        elif name == "bf16":
            model = model.to(torch.bfloat16)
        else:
            tok.add_tokens(["<extra_token>"])
            model.resize_token_embeddings(len(tok))
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        shutil.copy(os.path.join(TINY, "chat_template.jinja"), root / name / "chat_template.jinja")
        made[name] = str(root / name)
    assert len(tokenizer) + 1 == len(AutoTokenizer.from_pretrained(made["bigger_vocab"]))
    return made


def test_a_checkpoint_and_its_bf16_copy_have_one_fingerprint(models):
    ours = model_fingerprint(TINY)
    assert ours == model_fingerprint(models["bf16"]) and ours


def test_other_weights_and_another_vocabulary_give_other_fingerprints(models):
    ours = model_fingerprint(TINY)
    assert differences(ours, model_fingerprint(models["perturbed"])) == [
        "1 of the 50 tensors compared differ (model.layers.0.self_attn.q_proj.weight)"]
    token_table, config, weights = differences(ours, model_fingerprint(models["bigger_vocab"]))
    assert (token_table, config) == ("the token table differs", "the model config differs (fields vocab_size)")
    assert "tensors compared differ (model.embed_tokens.weight" in weights


@pytest.fixture(scope="module")
def perturbed_server(models, tmp_path_factory):
    """ref_server.py with its defaults (--device auto, --dtype auto), serving the perturbed model."""
    port, log = free_port(), tmp_path_factory.mktemp("log") / "server.out"
    with open(log, "w") as out:
        proc = start_ref_server(port, dict(os.environ), "--model", models["perturbed"], stdout=out)
    yield f"http://127.0.0.1:{port}", log
    stop(proc)


def test_the_server_says_what_it_serves_where_and_in_what_dtype(perturbed_server, models):
    url, log = perturbed_server
    health = requests.get(url + "/health", timeout=10).json()
    assert (health["model"], health["device"], health["dtype"], health["gpu"]) == (models["perturbed"], "cpu",
                                                                                 "float32", None)
    assert health["fingerprint"] == model_fingerprint(models["perturbed"])
    assert f"ref server: serves {models['perturbed']} on cpu in float32, listening on {url}" in log.read_text()


def test_a_trainer_refuses_a_server_with_another_model_naming_both(perturbed_server, models):
    """The full trainer, before it starts its generation worker."""
    url, _ = perturbed_server
    out = subprocess.run([sys.executable, "-m", "simple_grpo.train", "--ref_url", url, "--steps", "1", "--run_name",
                          "test_fingerprint_refused", "--overwrite"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0
    message = out.stderr.strip().splitlines()[-1]
    assert f"serves {models['perturbed']}" in message and "starts from models/tiny-math" in message, message
    assert "1 of the 50 tensors compared differ (model.layers.0.self_attn.q_proj.weight)" in message
    assert "--ref_model_differs_ok" in message
    assert "vLLM" not in out.stdout + out.stderr  # no worker was started
    assert not os.path.exists(os.path.join(runs_root(), "test_fingerprint_refused", "metrics.jsonl"))


def test_grpo_train_refuses_a_server_with_another_model_at_its_first_update(perturbed_server, models):
    """grpo_train.py (as grpo_vllm_one.py) checks the server by what it serves: at the first update the policy is
    still the reference, so the server's log-probs must be its own."""
    url, _ = perturbed_server
    out = subprocess.run([sys.executable, "grpo_train.py", "--ref_url", url, "--steps", "1", "--batch_prompts", "4",
                          "--run_name", "test_first_update_refused", "--overwrite"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0
    message = out.stderr.strip().splitlines()[-1]
    assert "the ref server's log-probs are" in message and "a token from ours" in message, message
    assert "another model than models/tiny-math (ref_server.py --model models/tiny-math?)" in message
    assert not os.path.exists(os.path.join(runs_root(), "test_first_update_refused", "metrics.jsonl"))


def test_ref_model_differs_ok_goes_on_and_says_so(perturbed_server, capsys):
    url, _ = perturbed_server
    cfg = Config(ref_url=url, ref_model_differs_ok=True)
    check_reference(cfg)
    assert f"note: the ref server at {url} serves" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--ref_model_differs_ok"):
        check_reference(Config(ref_url=url))


def test_lora_with_its_own_base_as_the_reference_never_asks_a_server(perturbed_server):
    """--use_peft without --ref_url: the base, adapters off, is the reference; --beta 0: no reference at all."""
    from simple_grpo.protocol import uses_ref_server
    from simple_grpo.trainer.config import check_options
    lora, no_kl = Config(use_peft=True), Config(beta=0.0, ref_url=perturbed_server[0])
    check_options(lora), check_options(no_kl)
    assert not uses_ref_server(lora) and not uses_ref_server(no_kl)
    check_reference(no_kl)  # beta 0: the server's model is not compared (no KL term to get wrong)
    lora_with_server = Config(use_peft=True, ref_url=perturbed_server[0])
    check_options(lora_with_server)
    with pytest.raises(SystemExit, match="starts from models/tiny-math"):  # the base is compared, as it should be
        check_reference(lora_with_server)


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """Copies of the tiny model's files, the weights untouched: {"same": as they are, "token_table": two tokens' ids
    swapped in tokenizer.json, "config": config.json's rope_theta and max_position_embeddings changed, "bin_only":
    the weights in pytorch_model.bin instead of model.safetensors}: directories."""
    root, made = tmp_path_factory.mktemp("copies"), {}
    for name in ("same", "token_table", "config", "bin_only"):
        made[name] = str(shutil.copytree(TINY, root / name))
    path = os.path.join(made["token_table"], "tokenizer.json")
    tokenizer = json.load(open(path))
    vocab = tokenizer["model"]["vocab"]
    vocab["0"], vocab["1"] = vocab["1"], vocab["0"]
    json.dump(tokenizer, open(path, "w"))
    path = os.path.join(made["config"], "config.json")
    config = json.load(open(path))
    config["rope_parameters"]["rope_theta"], config["max_position_embeddings"] = 500000.0, 1024
    json.dump(config, open(path, "w"))
    weights = os.path.join(made["bin_only"], "model.safetensors")
    torch.save(load_file(weights), os.path.join(made["bin_only"], "pytorch_model.bin"))
    os.remove(weights)
    return made


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """ref_server.py serving models/tiny-math: the trainer's --model is what each test varies."""
    port, log = free_port(), tmp_path_factory.mktemp("log") / "server.out"
    with open(log, "w") as out:
        proc = start_ref_server(port, dict(os.environ), "--model", TINY, stdout=out)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


def test_a_copy_with_the_same_files_passes(tiny_server, copies):
    check_reference(Config(ref_url=tiny_server, model=copies["same"]))


def test_the_same_weights_with_another_token_table_are_refused_naming_it(tiny_server, copies):
    with pytest.raises(SystemExit, match=r"token_table: the token table differs\. .*--ref_model_differs_ok"):
        check_reference(Config(ref_url=tiny_server, model=copies["token_table"]))


def test_the_same_weights_with_another_config_are_refused_naming_its_fields(tiny_server, copies):
    fields = r"\(fields max_position_embeddings, rope_parameters\)"
    with pytest.raises(SystemExit, match=r"config: the model config differs " + fields + r"\. "):
        check_reference(Config(ref_url=tiny_server, model=copies["config"]))


def test_weights_that_cannot_be_fingerprinted_are_refused_saying_so(tiny_server, copies):
    cause = r"the weights cannot be compared: no safetensors files in this run's model"
    with pytest.raises(SystemExit, match=r"bin_only: " + cause):
        check_reference(Config(ref_url=tiny_server, model=copies["bin_only"]))
