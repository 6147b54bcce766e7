"""The trainer's weights to the generation workers through shared memory, one weight at a time and with LoRA each
merged as it is copied (WeightSender, receive_weights), and which weights sample which batch (WorkerSchedule)."""
import contextlib
import math
import queue
import time

import torch

from simple_grpo.devices import check_shared_memory


def weight_groups(module):
    """The policy's weights in the groups the sync gathers one at a time, one per submodule: [(parameters, [(name,
    tensor, lora_layer)])]. name: a plain HF model's; tensor: the module's own (ZeRO-3: a shard until gathered);
    lora_layer: the PEFT layer whose adapters merge into it, else None (adapters are parameters, not weights)."""
    groups = {}  # the group's module name: (parameters, weights)
    for key, tensor in module.state_dict(keep_vars=True).items():
        owner = key.rpartition(".")[0]  # the submodule that holds it
        for part in (".base_layer.", ".lora_"):  # PEFT: q_proj.base_layer.weight, q_proj.lora_A.default.weight
            if part in key:
                owner = key.split(part)[0]  # the LoRA layer, q_proj
                break
        parameters, weights = groups.setdefault(owner, ([], []))
        if isinstance(tensor, torch.nn.Parameter):
            parameters.append(tensor)
        if ".lora_" in key:
            continue  # an adapter: merged into its layer's weight, not sent
        lora_layer = module.get_submodule(owner) if key.endswith(".base_layer.weight") else None
        weights.append((key.removeprefix("base_model.model.").replace(".base_layer.", "."), tensor, lora_layer))
    return list(groups.values())


def merged_weights(module, gather=contextlib.nullcontext):
    """The policy's weights, one (name, tensor) at a time; with LoRA each adapted one merged only when asked for (a
    caller that copies each and lets it go holds one at a time). gather(parameters) holds a group whole meanwhile."""
    for parameters, weights in weight_groups(module):
        with gather(parameters):
            for name, tensor, lora_layer in weights:
                yield name, (tensor.detach() if lora_layer is None else merged(lora_layer, tensor.detach()))


def merged(lora_layer, weight):
    """W + (lora_alpha / lora_r) * B @ A for each of the layer's active adapters, a new tensor."""
    for adapter in lora_layer.active_adapters:
        weight = weight + lora_layer.get_delta_weight(adapter).to(weight.dtype)
    return weight


def merged_shapes(module):
    """What merged_weights(module) yields, known before anything is gathered: {name: (dtype, shape, first)}, first
    the name the same tensor came under first (tied: lm_head.weight is model.embed_tokens.weight)."""
    shapes, first = {}, {}  # first: id of a tensor -> the name it came under first
    for _, weights in weight_groups(module):
        for name, tensor, lora_layer in weights:
            came_first = name if lora_layer is not None else first.setdefault(id(tensor), name)
            shapes[name] = (tensor.dtype, tuple(getattr(tensor, "ds_shape", tensor.shape)), came_first)  # ZeRO-3
    return shapes


def weight_layout(shapes):
    """Where each weight sits in one flat byte buffer: {name: (offset, dtype, shape)}, and the buffer's size.
    shapes: merged_shapes; a tied weight (lm_head = embeddings) shares the place of the name it came first as."""
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
    """The trainer's end, one per rank: the weights are copied one at a time into one of two flat buffers in shared
    memory that its workers map, and (version, buffer index) goes on each worker's queue. A buffer is refilled once
    every worker has loaded the version it holds or passed it over (`loaded`: a shared integer per worker)."""

    def __init__(self, queues, loaded):
        self.queues, self.loaded = queues, loaded  # one of each per worker
        self.buffers, self.held, self.layout, self.syncs = None, [-1, -1], None, 0

    def send(self, module, version, zero_stage=0, check_alive=lambda: None, timeout=600.0):
        """Every rank calls it: under ZeRO-3 all gather one module at a time (a rank with no workers only that)."""
        gather = contextlib.nullcontext
        if zero_stage == 3:  # ZeRO-3 keeps each parameter in shards: gather one module's whole while it is copied
            import deepspeed
            gather = deepspeed.zero.GatheredParameters
        if not self.queues:
            for parameters, _ in weight_groups(module):  # the gathers merged_weights makes, in its order
                with gather(parameters):
                    pass
            return
        if self.buffers is None:  # first sync: allocate, and hand the workers the buffers once
            self.layout, size = weight_layout(merged_shapes(module))
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
        views = tensors_in(self.buffers[i], self.layout)
        with torch.no_grad():
            for name, weight in merged_weights(module, gather):  # with LoRA: base + adapters, merged
                views[name].copy_(weight)
                del weight  # let this merged copy go before the next one is made
        self.held[i] = version
        for q in self.queues:
            q.put(("weights", version, i))


def receive_weights(llm, message, shared, loaded):
    """The worker's end: the buffers (once), kept in `shared`, or (version, buffer index) to load into vLLM;
    returns the version loaded, or None."""
    if message[0] == "buffers":
        shared["buffers"], shared["layout"] = message[1], message[2]
        return None
    _, version, i = message
    load_weights(llm, tensors_in(shared["buffers"][i], shared["layout"]))
    loaded.value = version
    return version


def load_weights(llm, state_dict):
    """Copy new weights into the running engine in place: all of them, lm_head.weight even when tied (vLLM on CPU
    keeps its own packed copy of it), fused groups (q/k/v, gate/up) whole. The prefix cache held old weights' KV."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state_dict.items())})
    llm.reset_prefix_cache()


def sampling_version(batch_index, cfg):
    """The policy version that samples a rank's batch number batch_index (trained at step batch_index + 1): the
    oldest the staleness bound --max_policy_lag allows, among the versions sent every --sync_every steps."""
    oldest = max(batch_index - cfg.max_policy_lag, 0)
    return -(-oldest // cfg.sync_every) * cfg.sync_every


def most_batches_per_call(cfg):
    """At most this many batches in one vLLM call of a worker's: --max_policy_lag (1 below 2, and with --regroup)."""
    return 1 if cfg.regroup else max(cfg.max_policy_lag, 1)


def call_batches(first, n_ranks, cfg):
    """The batch numbers one vLLM call samples, from this worker's next, `first`: with --max_policy_lag k >= 2 up to
    k of its batches (first, + gen_workers, ...), as long as one version allows each of them (sampling_version of
    the last, within the bound for all) and that version is out a step before `first` trains, so that the call
    overlaps a step of the trainer's (at the very start: version 0). k = 1 or --regroup: [first]."""
    newest = max(first // n_ranks - 1, sampling_version(first // n_ranks, cfg))  # the newest the call may wait for
    batches = [first]
    while (len(batches) < most_batches_per_call(cfg)
           and sampling_version((batches[-1] + cfg.gen_workers) // n_ranks, cfg) <= newest):
        batches.append(batches[-1] + cfg.gen_workers)
    return batches


class WorkerSchedule:
    """A generation worker's weights and batch numbers (docs/guide.md: "Which weights sample which batch"). Version
    v is the weights after step v. Batch b (first_batch_index, + gen_workers, ...; rank b % n's number b // n) is
    sampled in a vLLM call with the batches call_batches gives, by sampling_version of the call's last (at lag 1:
    each batch by sampling_version(b // n)): the worker waits for it, holds newer weights back, and passes older ones
    (another worker's) over. --regroup: no wait, nothing held back."""

    def __init__(self, cfg, llm, channels, n_ranks, first_batch_index, draw):
        self.cfg, self.llm, self.channels, self.n, self.draw = cfg, llm, channels, n_ranks, draw
        self.version = None if cfg.resume else 0  # of the loaded weights; None: the checkpoint's are on their way
        self.batch_index, self.draws = first_batch_index, 0  # the next batch's number; problem draws so far
        self.held, self.shared, self.load_s, self.waiting_since = None, {}, 0.0, None
        self.calls = 0  # vLLM calls made so far

    def batches(self):
        """The batch numbers the next vLLM call samples (call_batches)."""
        return call_batches(self.batch_index, self.n, self.cfg)

    def draw_problems(self):
        """The next batch's problems, counted in draws (the data position a checkpoint keeps)."""
        problems = self.draw()
        self.draws += 1
        return problems

    def take_weights_or_wait(self):
        """Take the next message from the trainer (waiting up to 1 s where weights are due) and act on it. True when
        the next call's batches may be sampled now; ends the run if due weights have not come in --data_timeout."""
        cfg, channels = self.cfg, self.channels
        last = self.batches()[-1] // self.n  # the rank's number of the call's last batch: the bound binds there
        lag = None if self.version is None else last - self.version  # were it sampled now
        must_wait = lag is None or (not cfg.regroup and lag > cfg.max_policy_lag)
        message, self.held = self.held, None  # weights held back before the last batch come first
        if message is None:
            try:
                message = channels.weights.get(timeout=1.0) if must_wait else channels.weights.get_nowait()
            except queue.Empty:
                pass
        if message is not None and message[0] == "weights" and self.version is not None and not cfg.regroup:
            due = sampling_version(last, cfg)  # the version that samples the next call
            if message[1] > due:
                message, self.held = None, message  # too new for the next call: loaded once it is sampled
            elif message[1] < due:  # too old: another worker's batch was sampled with it
                channels.loaded.value, message = message[1], None  # passed over, never loaded: its buffer is free
        self.waiting_since = (self.waiting_since or time.time()) if must_wait and message is None else None
        if self.waiting_since is not None and time.time() - self.waiting_since > cfg.data_timeout:
            needed = last - cfg.max_policy_lag
            raise SystemExit(f"generation worker: no new weights from the trainer in {cfg.data_timeout:.0f} s "
                             f"(it has version {self.version}, needs {needed})")
        if message is not None and message[0] == "resume":  # the checkpoint's batch number and data position
            _, self.batch_index, self.draws = message
            for _ in range(self.draws):  # replay the draws the checkpoint's batches took
                self.draw()
        elif message is not None:  # the buffers (once), or weights to load before sampling more
            t0 = time.time()
            if (version := receive_weights(self.llm, message, self.shared, channels.loaded)) is not None:
                self.version, self.load_s = version, time.time() - t0
        return message is None and not must_wait

    def sampled(self, kept):
        """After a batch: on to this worker's next number if any group was kept (else it samples again)."""
        self.batch_index += self.cfg.gen_workers if kept else 0
