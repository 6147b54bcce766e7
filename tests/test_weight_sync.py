"""The weight sync (simple_grpo/generation/weight_sync.py, merged_weights): what lands in the shared buffer is
the policy's weights exactly, LoRA's merged as PEFT merges them, with tied weights in one place; the layout is known
before anything is merged; send() makes one merged weight at a time; under ZeRO-3 on 2 ranks, gathering one module
at a time gives what gathering the whole model gives (slow: tests/weight_sync_zero3.py)."""
import json
import os
import queue
import socket
import subprocess
import sys
import types
import weakref

import pytest
import torch

from simple_grpo.generation import weight_sync
from simple_grpo.generation.weight_sync import WeightSender, merged_shapes, merged_weights, tensors_in, weight_layout


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "models", "tiny-math")  # its lm_head is tied to its embeddings


def lora_model(dtype):
    """The tiny model with all-linear LoRA adapters, B random (PEFT's default starts it at 0, a merge of nothing),
    the adapters in the base's dtype as DeepSpeed holds them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(TINY, dtype=dtype)
    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(base, config).to(dtype).eval()


def sent(module):
    """What one WeightSender.send puts in the shared buffer, as a worker reads it: {name: tensor}."""
    sender = WeightSender([queue.SimpleQueue()], [types.SimpleNamespace(value=0)])
    sender.send(module, version=1)
    return tensors_in(sender.buffers[0], sender.layout), sender.layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_buffer_holds_the_lora_weights_merged_exactly_as_peft_merges_them(dtype):
    import copy
    model = lora_model(dtype)
    got, _ = sent(model)
    merged = copy.deepcopy(model).merge_and_unload().state_dict()  # PEFT's merge, in place: W += B @ A * scale
    assert list(got) == list(merged)
    assert [key for key in merged if not torch.equal(got[key], merged[key])] == []
    base = {key.removeprefix("base_model.model.").replace(".base_layer.", "."): t
            for key, t in model.state_dict().items() if ".lora_" not in key}
    # the merge changed the adapted weights alone: 4 layers x q, k, v, o, gate, up, down
    assert sum(not torch.equal(got[key], base[key]) for key in got) == 4 * 7


def test_the_buffer_holds_a_whole_models_state_dict_exactly():
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    got, _ = sent(model)
    state = model.state_dict()
    assert list(got) == list(state) and all(torch.equal(got[key], state[key]) for key in state)


def test_the_layout_comes_from_the_shapes_before_anything_is_merged_and_tied_weights_share_a_place():
    model = lora_model(torch.bfloat16)
    layout, size = weight_layout(merged_shapes(model))
    with torch.no_grad():
        weights = dict(merged_weights(model))
    assert list(layout) == list(weights)
    assert all((dtype, shape) == (weights[key].dtype, tuple(weights[key].shape))
               for key, (_, dtype, shape) in layout.items())
    assert layout["lm_head.weight"] == layout["model.embed_tokens.weight"]  # tied: one place
    places = {offset for offset, _, _ in layout.values()}
    assert len(places) == len(layout) - 1  # every other weight, merged ones included, has its own
    assert size == sum(-(-t.numel() * t.element_size() // 64) * 64 for key, t in weights.items()
                       if key != "lm_head.weight")


def test_send_holds_one_merged_weight_at_a_time(monkeypatch):
    """When send() copies a merged weight, the ones before it are gone: none outlives its copy."""
    model = lora_model(torch.bfloat16)
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    made, alive_at_each = [], []

    def watched(module, gather):
        for name, weight in merged_weights(module, gather):
            alive_at_each.append(sum(ref() is not None for ref in made))  # the merged weights made before this one
            if weight.untyped_storage().data_ptr() not in own:
                made.append(weakref.ref(weight))
            yield name, weight
            del weight
    monkeypatch.setattr(weight_sync, "merged_weights", watched)
    sent(model)
    assert len(made) == 4 * 7 and max(alive_at_each) == 0
    assert all(ref() is None for ref in made)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # ~2 min: two engines on 2 ranks
def test_under_zero3_gathering_one_module_at_a_time_sends_what_the_whole_model_holds():
    """2 ranks, every parameter a shard: rank 0 sends (one module gathered at a time), rank 1 joins the same gathers;
    the buffer equals merged_weights of the whole gathered model exactly, whole and with LoRA (its 28 adapted
    weights changed by the merge), with the tied lm_head in the embeddings' place."""
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2",
                          "--master_port", str(free_port()), "tests/weight_sync_zero3.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    cases = {r["case"]: r for r in map(json.loads, [s for s in out.stdout.splitlines() if s.startswith("{")])}
    assert set(cases) == {"full", "lora"}, out.stdout[-3000:]
    for case in cases.values():
        assert case["names"] and case["weights"] == 51 and case["differ"] == [], case
        assert case["tied"] and case["embed_shape"] == [561, 192], case
        assert case["shards"] == case["parameters"], case  # nothing was whole before the sync gathered it
    assert cases["full"]["merged"] == 0 and cases["lora"]["merged"] == 4 * 7
