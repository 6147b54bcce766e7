"""Where an update's seconds go, phase by phase: simple_grpo.train --time_phases (bench/gpu_scale.py sets it) logs
them to metrics.jsonl as keys ending in _s (timings: tools/compare_runs.py leaves them out). An update that is not
timed imports none of this: no hook, no wait.

  forward      the model's forward passes (the prompts and the completions), up to the logits
  log_softmax  the log-probs and the entropy from the logits, and in backward their gradient (with the loss's few
               element-wise ops, whose backward runs first)
  recompute    with --gradient_checkpointing: the decoder layers' forward again, inside backward
  backward     the rest of backward: the layers' gradients and DeepSpeed's reduction of them
  loss         grpo_math.grpo_loss on the log-probs
  optimizer    engine.step(): the clip, AdamW and the copies back
and, where the update is profiled (simple_grpo.train --profile_step, CUDA only), apart from the phases:
  gpu_wait     the update's seconds in which the GPU ran no kernel and no copy (torch.profiler's trace)

timed_update puts hooks on the model and wrappers on the engine's methods for one update, each marking where a
phase starts, and takes them off after it. On CUDA each mark waits for the GPU (synchronized_time), so a phase's
seconds are its work's, not its launch's.
"""
import time

import torch

PHASES = ("forward", "log_softmax", "recompute", "backward", "loss", "optimizer")


def synchronized_time():
    """time.time() once the GPU has finished what was queued on it (CUDA runs asynchronously)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.time()


def timed_update(update, engine, batch, cfg, profile=False):
    """update(engine, batch, cfg) (trainer/update.py's grpo_update) timed by phase: its stats gain forward_s,
    log_softmax_s, recompute_s, backward_s, loss_s, optimizer_s, and with profile gpu_wait_s."""
    with UpdatePhases(engine, profile) as phases:
        stats, logps = update(engine, batch, cfg)
    return {**stats, **phases.spent_s}, logps


class UpdatePhases:
    """The seconds of one update by phase: `with UpdatePhases(engine):` around it; then spent_s."""

    def __init__(self, engine, profile=False):
        if profile and not torch.cuda.is_available():
            raise ValueError("profiling an update measures the GPU's idle seconds in it: it needs CUDA")
        self.engine, self.hooks, self.spent_s, self.phase = engine, [], {}, None
        self.spent = dict.fromkeys(PHASES, 0.0)
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if profile else None

    def start(self, phase):
        """The phase running now ends and `phase` starts (None: outside every phase)."""
        now = synchronized_time()
        if self.phase:
            self.spent[self.phase] += now - self.since
        self.phase, self.since = phase, now

    def __enter__(self):
        model = self.engine.module
        self.hooks = [model.register_forward_pre_hook(lambda *_: self.start("forward")),
                      model.register_forward_hook(lambda *_: self.start("log_softmax"), always_call=True),
                      model.get_output_embeddings().register_forward_hook(self.watch_logits)]
        if getattr(model, "is_gradient_checkpointing", False):  # the layers that checkpointing runs again
            from transformers.modeling_layers import GradientCheckpointingLayer
            for layer in (m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)):
                # always_call: a recompute stops with an exception once it has made what backward needs
                self.hooks += [layer.register_forward_pre_hook(self.recompute_starts),
                               layer.register_forward_hook(self.recompute_ends, always_call=True)]
        # grpo_update sets the accumulation boundary between a pass's log-probs and its loss
        self.wrap("set_gradient_accumulation_boundary", "loss", "loss")
        self.wrap("backward", "log_softmax", None)
        self.wrap("step", "optimizer", None)
        if self.profiler:
            self.profiler.__enter__()
        self.phase, self.started = None, synchronized_time()
        return self

    def __exit__(self, *_):
        for hook in self.hooks:
            hook.remove()
        for name in ("set_gradient_accumulation_boundary", "backward", "step"):
            delattr(self.engine, name)  # the engine's own methods again
        self.start(None)
        self.spent_s = {f"{phase}_s": seconds for phase, seconds in self.spent.items()}
        if self.profiler:
            seconds = synchronized_time() - self.started
            self.profiler.__exit__(None, None, None)
            self.spent_s["gpu_wait_s"] = seconds - busy_seconds(self.profiler.events(), torch.autograd.DeviceType.CUDA)

    def wrap(self, name, phase, after):
        """engine.<name>(...) starts `phase`, and `after` once it returns."""
        method = getattr(self.engine, name)

        def timed(*args, **kwargs):
            self.start(phase)
            try:
                return method(*args, **kwargs)
            finally:
                self.start(after)
        setattr(self.engine, name, timed)

    def watch_logits(self, _head, _inputs, logits):
        """The output head's forward hook: backward's log-softmax phase ends when the logits' gradient is made."""
        if logits.requires_grad:
            logits.register_hook(self.logits_grad_ready)

    def logits_grad_ready(self, _grad):
        if self.phase == "log_softmax":
            self.start("backward")

    def recompute_starts(self, *_):
        if self.phase in ("log_softmax", "backward"):  # a layer's forward inside backward is checkpointing's
            self.start("recompute")

    def recompute_ends(self, *_):
        if self.phase == "recompute":
            self.start("backward")


def busy_seconds(events, device_type):
    """The seconds in which a device ran something, from a torch.profiler trace's events: the union of the
    intervals of those on `device_type` (kernels on a GPU may overlap, on several streams, and a CPU's ops nest)."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == device_type):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e6  # the trace's times are in microseconds
