"""Weights from the trainer to the generation workers, in memory (grpo_vllm_one.py).

The trainer copies its weights into one of two flat buffers in shared memory that every process
maps (WeightSender.send: a copy per tensor, nothing pickled) and sends (version, buffer index) on each
worker's queue; each worker loads them into its running vLLM engine in place (receive_weights).
A buffer is refilled only after every worker has loaded the version it held (or passed it over:
with several workers, each loads just the versions it samples with).
"""
import contextlib
import math
import time

import torch

from simple_grpo.devices import check_shared_memory
from simple_grpo.lora import merged_weights


def weight_layout(state_dict):
    """Where each tensor sits in one flat byte buffer: {name: (offset, dtype, shape)}, and the
    buffer's size. Tied tensors (embeddings = lm_head) share one place."""
    layout, places, size = {}, {}, 0
    for name, t in state_dict.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key not in places:
            places[key] = size
            size += -(-t.numel() * t.element_size() // 64) * 64  # keep every tensor 64-byte aligned
        layout[name] = (places[key], t.dtype, tuple(t.shape))
    return layout, size


def tensors_in(buffer, layout):
    """The state dict as views into the flat buffer (no copy)."""
    return {name: buffer[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for name, (offset, dtype, shape) in layout.items()}


class WeightSender:
    """The trainer's end of the weight sync, all in memory, to one or several workers.

    The weights are copied into a flat buffer in shared memory that every worker maps, and
    only (version, buffer index) goes through each worker's queue: one memcpy per sync however
    many workers read it, no pickling of tensors, no allocation after the first. Two buffers are
    used in turn, and one is refilled only after every worker has loaded the version it held, or
    passed it over for a newer one (`loaded`: a shared integer per worker), so no worker reads
    weights being overwritten."""

    def __init__(self, queues, loaded):
        self.queues, self.loaded = queues, loaded  # one of each per worker
        self.buffers, self.held, self.layout, self.syncs = None, [-1, -1], None, 0

    def send(self, module, version, zero_stage=0, check_alive=lambda: None, timeout=600.0):
        gather = contextlib.nullcontext()
        if zero_stage == 3:  # ZeRO-3 keeps each parameter in shards: gather them whole first
            import deepspeed
            gather = deepspeed.zero.GatheredParameters(list(module.parameters()))
        with gather, torch.no_grad():
            state_dict = merged_weights(module)  # with LoRA: base + adapters, merged
            if self.buffers is None:  # first sync: allocate, and hand the workers the buffers once
                self.layout, size = weight_layout(state_dict)
                check_shared_memory(2 * size)
                self.buffers = [torch.empty(size, dtype=torch.uint8).share_memory_() for _ in range(2)]
                for q in self.queues:
                    q.put(("buffers", self.buffers, self.layout))
            i, self.syncs = self.syncs % 2, self.syncs + 1
            deadline = time.time() + timeout
            while (slowest := min(loaded.value for loaded in self.loaded)) < self.held[i]:  # still needed
                check_alive()
                if time.time() > deadline:
                    raise SystemExit(f"a generation worker has not loaded weights version {self.held[i]} in "
                                     f"{timeout:.0f} s (--data_timeout; it has {slowest}): see its log above")
                time.sleep(0.001)
            for name, view in tensors_in(self.buffers[i], self.layout).items():
                view.copy_(state_dict[name])
        self.held[i] = version
        for q in self.queues:
            q.put(("weights", version, i))


def receive_weights(llm, message, shared, loaded):
    """The worker's end: a sync message is either the buffers (once), kept in `shared`, or
    (version, buffer index) to load into vLLM. Returns the version loaded, or None."""
    if message[0] == "buffers":
        shared["buffers"], shared["layout"] = message[1], message[2]
        return None
    _, version, i = message
    load_weights(llm, tensors_in(shared["buffers"][i], shared["layout"]))
    loaded.value = version
    return version


def sync_weights(sender, engine, version, zero_stage, check_alive, timeout):
    """Every rank calls it: under ZeRO-3 every rank takes part in gathering the weights whole;
    each rank that runs workers (sender not None) sends them to its workers."""
    if sender is not None:
        sender.send(engine.module, version, zero_stage, check_alive, timeout)
    elif zero_stage == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            pass


def load_weights(llm, state_dict):
    """Copy new weights into the running engine in place. All of them, lm_head.weight included
    even when tied (vLLM on CPU keeps its own packed copy of the output layer), and fused
    groups (q/k/v, gate/up) whole. The prefix cache holds KV computed with the old weights."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state_dict.items())})
    llm.reset_prefix_cache()
