"""Weights from the trainer to the generation workers, in memory (grpo_vllm_one.py).

The trainer copies its weights into one of two flat buffers in shared memory that every process
maps (WeightSender.send: a copy per tensor, nothing pickled) and sends (version, buffer index) on each
worker's queue; each worker loads them into its running vLLM engine in place (receive_weights).
The weights go one at a time: with LoRA each merged weight is made just before its copy and freed after
it, and under ZeRO-3 one module's parameters are gathered whole at a time (lora.merged_weights).
A buffer is refilled only after every worker has loaded the version it held (or passed it over:
with several workers, each loads just the versions it samples with).
"""
import contextlib
import math
import time

import torch

from simple_grpo.devices import check_shared_memory
from simple_grpo.lora import merged_shapes, merged_weights, weight_groups


def weight_layout(shapes):
    """Where each weight sits in one flat byte buffer: {name: (offset, dtype, shape)}, and the buffer's size.
    shapes: {name: (dtype, shape, first)} (lora.merged_shapes); a weight whose tensor came first under another
    name (tied: lm_head = embeddings) shares that one's place."""
    layout, size = {}, 0
    for name, (dtype, shape, first) in shapes.items():
        if first != name:
            layout[name] = layout[first]
            continue
        layout[name] = (size, dtype, shape)
        size += -(-math.prod(shape) * dtype.itemsize // 64) * 64  # keep every tensor 64-byte aligned
    return layout, size


def tensors_in(buffer, layout):
    """The state dict as views into the flat buffer (no copy)."""
    return {name: buffer[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for name, (offset, dtype, shape) in layout.items()}


class WeightSender:
    """The trainer's end of the weight sync, all in memory, to one or several workers.

    The weights are copied into a flat buffer in shared memory that every worker maps, and
    only (version, buffer index) goes through each worker's queue: one copy of each tensor per sync
    however many workers read it, no pickling of tensors, no allocation after the first. Two buffers are
    used in turn, and one is refilled only after every worker has loaded the version it held, or
    passed it over for a newer one (`loaded`: a shared integer per worker), so no worker reads
    weights being overwritten."""

    def __init__(self, queues, loaded):
        self.queues, self.loaded = queues, loaded  # one of each per worker
        self.buffers, self.held, self.layout, self.syncs = None, [-1, -1], None, 0

    def send(self, module, version, zero_stage=0, check_alive=lambda: None, timeout=600.0):
        if self.buffers is None:  # first sync: allocate, and hand the workers the buffers once
            self.layout, size = weight_layout(merged_shapes(module))  # from the shapes: nothing merged yet
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
        gather = contextlib.nullcontext
        if zero_stage == 3:  # ZeRO-3 keeps each parameter in shards: gather one module's whole while it is copied
            import deepspeed
            gather = deepspeed.zero.GatheredParameters
        views = tensors_in(self.buffers[i], self.layout)
        with torch.no_grad():
            for name, weight in merged_weights(module, gather):  # with LoRA: base + adapters, merged
                views[name].copy_(weight)
                del weight  # let this merged copy go before the next one is made
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
    """Every rank calls it: under ZeRO-3 every rank takes part in gathering the weights whole, one module
    at a time in the sender's order (lora.weight_groups); each rank that runs workers (sender not None)
    sends them to its workers."""
    if sender is not None:
        sender.send(engine.module, version, zero_stage, check_alive, timeout)
    elif zero_stage == 3:
        import deepspeed
        for parameters, _ in weight_groups(engine.module):  # the gathers merged_weights makes, in its order
            with deepspeed.zero.GatheredParameters(parameters):
                pass


def load_weights(llm, state_dict):
    """Copy new weights into the running engine in place. All of them, lm_head.weight included
    even when tied (vLLM on CPU keeps its own packed copy of the output layer), and fused
    groups (q/k/v, gate/up) whole. The prefix cache holds KV computed with the old weights."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state_dict.items())})
    llm.reset_prefix_cache()
