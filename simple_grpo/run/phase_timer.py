"""Where the update's seconds go, phase by phase: grpo_vllm_one.py's update (trainer/update.py) logs them to
metrics.jsonl as keys ending in _s (timings: tools/compare_runs.py leaves them out), bench/gpu_scale.py prints them.

  forward      the model's forward passes (the prompts and the completions), up to the logits
  log_softmax  the log-softmax over the vocabulary: the log-probs and the entropy from the logits, and in
               backward their gradient (with the loss's few element-wise ops, whose backward runs first)
  recompute    with --gradient_checkpointing: the decoder layers' forward again, inside backward
  backward     the rest of backward: the layers' gradients, and DeepSpeed's reduction of them (with
               --offload_optimizer, their copy to the host)
  loss         grpo_math.grpo_loss on the log-probs
  optimizer    engine.step(): the clip, AdamW (on the host with --offload_optimizer) and the copies back
and, where the update is profiled (grpo_vllm_one.py --profile_step, CUDA only), apart from the phases:
  gpu_wait     the update's seconds in which the GPU ran no kernel and no copy (torch.profiler's trace)

The model's phases are found by hooks on its modules (forward: the whole model's forward; log_softmax's
backward: until the logits' gradient is ready; recompute: a checkpointed layer's forward while backward runs),
put on for one update and taken off after it. On CUDA each boundary waits for the GPU (synchronized_time), so a
phase's seconds are its work's, not its launch's. So it is opt-in (grpo_vllm_one.py --time_phases; bench/gpu_scale.py
sets it): an update that is not timed runs with Untimed, no hook and no wait.
"""
import time
from contextlib import contextmanager, nullcontext

import torch

PHASES = ("forward", "log_softmax", "recompute", "backward", "loss", "optimizer")


def synchronized_time():
    """time.time() once the GPU has finished what was queued on it (CUDA runs asynchronously), so that the
    seconds between two calls are the work's own."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.time()


class UpdatePhases:
    """The seconds of one update by phase (PHASES). Used as `with UpdatePhases(engine) as phases:` around it;
    inside, `with phases.forward():` around a log-prob pass (forward and log_softmax), `with phases.backward():`
    around engine.backward (log_softmax's backward, recompute, backward), `with phases.timed(phase):` around
    a phase that is whole (loss, optimizer). phases.seconds() is {"forward_s": ..., ...} for the log."""

    def __init__(self, engine, profile=False):
        if profile and not torch.cuda.is_available():
            raise ValueError("profiling an update measures the GPU's idle seconds in it: it needs CUDA")
        self.model, self.profiler = engine.module, None
        self.spent = dict.fromkeys(PHASES, 0.0)
        self.in_backward, self.hooks = False, []
        self.model_forward_s, self.recompute_s, self.logits_grad_at = 0.0, 0.0, None  # the hooks fill these in
        if profile:  # the GPU's own activity: its kernels and copies, with their start and end
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])

    def __enter__(self):
        model = self.model
        self.hooks += [model.register_forward_pre_hook(self.model_forward_starts),
                       model.register_forward_hook(self.model_forward_ends, always_call=True),
                       model.get_output_embeddings().register_forward_hook(self.watch_logits)]
        if getattr(model, "is_gradient_checkpointing", False):  # the layers that checkpointing runs again
            from transformers.modeling_layers import GradientCheckpointingLayer
            for layer in (m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)):
                # always_call: a recompute stops with an exception once it has made what backward needs
                self.hooks += [layer.register_forward_pre_hook(self.recompute_starts),
                               layer.register_forward_hook(self.recompute_ends, always_call=True)]
        if self.profiler:
            self.profiler.__enter__()
        self.started = synchronized_time()
        return self

    def __exit__(self, *_):
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        if self.profiler:
            seconds = synchronized_time() - self.started
            self.profiler.__exit__(None, None, None)
            self.spent["gpu_wait"] = seconds - busy_seconds(self.profiler.events(), torch.autograd.DeviceType.CUDA)

    # the hooks
    def model_forward_starts(self, *_):
        self.model_forward_started = synchronized_time()

    def model_forward_ends(self, *_):
        self.model_forward_s += synchronized_time() - self.model_forward_started

    def watch_logits(self, _head, _inputs, logits):
        """The output head's forward hook: backward will note when it has made the logits' gradient."""
        if logits.requires_grad:
            logits.register_hook(self.logits_grad_ready)

    def logits_grad_ready(self, _grad):
        self.logits_grad_at = self.logits_grad_at or synchronized_time()

    def recompute_starts(self, *_):
        if self.in_backward:  # a layer's forward inside backward is checkpointing's recompute
            self.recompute_started = synchronized_time()

    def recompute_ends(self, *_):
        if self.in_backward:
            self.recompute_s += synchronized_time() - self.recompute_started

    # the blocks
    @contextmanager
    def timed(self, phase):
        """A block that is one phase whole."""
        started = synchronized_time()
        yield
        self.spent[phase] += synchronized_time() - started

    @contextmanager
    def forward(self):
        """A log-prob pass: the model's forward, then the log-softmax over the vocabulary."""
        self.model_forward_s, started = 0.0, synchronized_time()
        yield
        self.spent["forward"] += self.model_forward_s
        self.spent["log_softmax"] += synchronized_time() - started - self.model_forward_s

    @contextmanager
    def backward(self):
        """engine.backward: the log-softmax's gradient until the logits' is ready, the recompute, the rest."""
        self.in_backward, self.logits_grad_at, self.recompute_s = True, None, 0.0
        started = synchronized_time()
        try:
            yield
        finally:
            self.in_backward = False
        to_logits = self.logits_grad_at - started if self.logits_grad_at else 0.0
        self.spent["log_softmax"] += to_logits
        self.spent["recompute"] += self.recompute_s
        self.spent["backward"] += synchronized_time() - started - to_logits - self.recompute_s

    def seconds(self):
        return {f"{phase}_s": seconds for phase, seconds in self.spent.items()}


class Untimed:
    """UpdatePhases's stand-in where the update is not timed (grpo_vllm_one.py without --time_phases): each
    block is a plain block, with no hook on the model and no wait for the GPU; seconds() is empty."""

    def __enter__(self):
        return self

    def __exit__(self, *_):
        pass

    def timed(self, phase):
        return nullcontext()

    def forward(self):
        return nullcontext()

    def backward(self):
        return nullcontext()

    def seconds(self):
        return {}


def busy_seconds(events, device_type):
    """The seconds in which a device ran something, from a torch.profiler trace's events: the union of the
    intervals of those on `device_type` (kernels on a GPU may overlap, on several streams, and a CPU's ops nest)."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == device_type):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e6  # the trace's times are in microseconds
