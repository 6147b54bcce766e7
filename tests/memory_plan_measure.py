"""What the full trainer's own code allocates on this CPU in each phase of a step that the memory plan has a row for,
for tests/test_memory_plan.py: a random model with a few small layers (and Qwen2.5's vocabulary of 151,936 ids, or
a small one), a real DeepSpeed engine (make_engine), one warm-up step, then the peak bytes above each phase's start
of the LoRA reference pass (reference_logps), the update (grpo_update: log-probs, loss, backward) and the weight
sync (WeightSender.send, its second call: the first allocates the shared buffers, the host's), from torch's profiler
(every CPU allocation); and the most bytes of merged weights (weight_sync.merged_weights) alive when send() copies one.

Left out of the update's peak: what the optimizer's step allocates (the plan's gradient and optimizer rows count
it), ZeRO-2's gradient bucket (reported apart: a row of the plan's margin), and two things only a CPU makes:
- a copy: torch.matmul on the lm_head's sliced input (the logits checkpointing keeps) multiplies by the frozen weight
  expanded over the batch, which CPU bmm makes contiguous (batch x hidden x vocab) and CUDA's bmm takes as it is
  (stride 0);
- a matrix product's workspace, which the product allocates and frees inside itself (every phase leaves it out;
  the largest is reported apart). Its size depends on the CPU: torch runs bf16 products with oneDNN on a CPU with
  AVX-512, whose kernel (ONEDNN_VERBOSE=1 names it) is brg_matmul where the CPU has AVX512-BF16 or AMX, with a few
  blocks of scratchpad (13 to 150 KB at the lm_head), and gemm:jit:bf16 where it has AVX-512 without BF16
  (Skylake, Cascade Lake, Ice Lake Xeons), whose scratchpad holds the whole product in float32 before it is rounded
  to bf16 (oneDNN's cpu/matmul/gemm_bf16_matmul.cpp books key_matmul_dst_in_acc_dt, M x N x 4 bytes: 114 MB for the
  lm_head's output, 39 MB for its weight's gradient); without AVX-512 torch's own kernel takes none. oneDNN takes it
  from torch's CPU allocator (ATen/native/mkldnn/IDeepRegistration.cpp), so the profiler sees it. cuBLAS's, on a
  GPU, is in the plan's margin.

    python tests/memory_plan_measure.py '{"lora": {"model": DIR, "shape": {...}, "Q": 1, "G": 4, "P": 16, "C": 48,
                                                   "flags": ["--use_peft", ...]}, ...}'

builds each run's model in its DIR once (Qwen2Config's keys in "shape"; bf16) and prints one JSON line per run:
{"name", "reference", "update", "bucket", "workspace", "merge" (the sync's peak), "merge_held"}, bytes.
"""
import json
import os
import queue
import sys
import types
import weakref

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo_math import completion_mask  # noqa: E402
from simple_grpo.train import Config  # noqa: E402
from simple_grpo.flags import parse_flags  # noqa: E402
from simple_grpo.generation import weight_sync  # noqa: E402
from simple_grpo.generation.weight_sync import merged_weights  # noqa: E402
from simple_grpo.trainer.config import check_options  # noqa: E402
from simple_grpo.trainer.deepspeed_engine import make_engine  # noqa: E402
from simple_grpo.trainer import update  # noqa: E402
from simple_grpo.trainer.update import grpo_update, reference_logps  # noqa: E402

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "tiny-math")


def build(path, shape):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config
    if os.path.exists(os.path.join(path, "config.json")):
        return
    torch.manual_seed(0)
    config = Qwen2Config(tie_word_embeddings=False, max_position_embeddings=4096, **shape)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    AutoTokenizer.from_pretrained(TINY).save_pretrained(path)


MATRIX_PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def allocations(fn):
    """fn's result and its CPU allocations in time order: (size, total allocated after it, ptr, op names above it,
    whether it is a matrix product's workspace: made by the product itself, and freed before that call returns)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    found, stack = [], [(e, (), None) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, above, op = stack.pop()  # op: the call the event sits in, (name, start)
        if event.tag == _EventType.Allocation:
            f = event.extra_fields
            found.append((event.start_time_ns, f.alloc_size, f.total_allocated, f.ptr, above, op))
        stack.extend((child, above + (event.name,), (event.name, event.start_time_ns)) for child in event.children)
    found.sort(key=lambda a: a[0])
    made_in = {}  # ptr: the call that allocated it, where that is a matrix product
    workspace = set()  # indices of the allocations freed inside the product call that made them
    for i, (_, size, _, ptr, _, op) in enumerate(found):
        if size > 0:
            made_in[ptr] = (i, op) if op and op[0] in MATRIX_PRODUCTS else None
        elif made_in.get(ptr) and made_in[ptr][1] == op:
            workspace.add(made_in.pop(ptr)[0])
    return result, [(size, total, ptr, above, i in workspace)
                    for i, (_, size, total, ptr, above, _) in enumerate(found)]


def workspace(size, above, in_product):
    """A matrix product's workspace (the module's docstring): the CPU's, not the plan's."""
    return in_product


def peak(events, leave_out=workspace):
    """The most bytes live at once above the phase's start, less the live allocations `leave_out` picks, and the
    largest of those."""
    if not events:
        return 0, 0
    start = events[0][1] - events[0][0]
    apart, most, largest_apart = {}, start, 0
    for size, total, ptr, above, in_product in events:
        if size > 0 and leave_out(size, above, in_product):
            apart[ptr] = size
            largest_apart = max(largest_apart, size)
        elif size < 0:
            apart.pop(ptr, None)
        most = max(most, total - sum(apart.values()))
    return most - start, largest_apart


def named_optimizer_step(engine, loss, step=update.optimizer_step):
    """update.optimizer_step under its name in the profile: what the step allocates (DeepSpeed's fp32 gradients
    and its copies) is the plan's gradient and optimizer rows, not the activations."""
    with torch.profiler.record_function("optimizer_step"):
        return step(engine, loss)


def watch_merged_weights(module, held):
    """While send() runs, weight_sync.merged_weights is this: the same weights, and after each it yields, `held`
    gets the bytes of the merged weights (tensors not the module's own) still alive then."""
    own = {p.untyped_storage().data_ptr() for p in module.parameters()}
    alive = []  # a weak reference to each merged weight made so far: dead once nothing holds it

    def watched(module, gather):
        for name, weight in merged_weights(module, gather):
            if weight.untyped_storage().data_ptr() not in own:
                alive.append(weakref.ref(weight))
            held.append(sum(t.untyped_storage().nbytes() for t in (ref() for ref in alive) if t is not None))
            yield name, weight
            del weight  # as send() does: the watcher must not keep it either
    weight_sync.merged_weights = watched


def measure(spec):
    Q, G, P, C, flags = spec["Q"], spec["G"], spec["P"], spec["C"], spec["flags"]
    cfg = parse_flags(Config, "", ["--model", spec["model"], "--dtype", "bfloat16", "--zero_stage", "2",
                                   "--threads", "1", "--lr", "1e-4", "--beta", "0.04", "--batch_prompts", str(Q),
                                   "--num_generations", str(G), "--max_new_tokens", str(C),
                                   "--max_model_len", str(P + C), "--micro_batch_groups", "1", *flags])
    check_options(cfg)
    engine, _ = make_engine(cfg)
    V, hidden = spec["shape"]["vocab_size"], spec["shape"]["hidden_size"]
    g = torch.Generator().manual_seed(0)
    batch = {"prompt_ids": torch.randint(3, V, (Q, P), generator=g), "prompt_mask": torch.ones(Q, P, dtype=torch.long),
             "completion_ids": torch.randint(3, V, (Q * G, C), generator=g),
             "advantages": torch.randn(Q * G, generator=g), "sampler_logps": -torch.rand(Q * G, C, generator=g)}
    batch["loss_mask"] = completion_mask(batch["completion_ids"], [0])  # no id 0 in them: every token counts
    reference = (lambda: reference_logps(engine, batch, cfg)) if cfg.use_peft else (lambda: -torch.rand(Q * G, C))
    batch["ref_logps"] = reference()
    grpo_update(engine, batch, cfg)  # the first step makes the optimizer's state: what the plan's states count

    def cpu_only(size, above, in_product):  # a product's workspace, or the lm_head's weight expanded over the
        # batch, made contiguous by CPU bmm
        return in_product or ("aten::bmm" in above and size >= Q * G * hidden * V * 2)

    def bucket(size, above, in_product):  # ZeRO-2's reduce bucket, taken at a backward's first gradient
        return "torch::autograd::AccumulateGrad" in above and size >= 1e8

    _, events = allocations(reference)
    ref_peak, _ = peak(events, cpu_only)
    _, ref_workspace = peak(events, workspace)
    _, events = allocations(lambda: grpo_update(engine, batch, cfg))
    update_peak, _ = peak(events, lambda *a: cpu_only(*a) or bucket(*a) or "optimizer_step" in a[1])
    _, bucket_bytes = peak(events, bucket)
    _, update_workspace = peak(events, lambda *a: workspace(*a) and "optimizer_step" not in a[1])
    sender = weight_sync.WeightSender([queue.SimpleQueue()], [types.SimpleNamespace(value=0)])  # a worker, in name
    sender.send(engine.module, version=1)  # the first sync allocates the shared buffers
    held = []
    watch_merged_weights(engine.module, held)
    _, events = allocations(lambda: sender.send(engine.module, version=2))
    weight_sync.merged_weights = merged_weights
    merge_peak, merge_workspace = peak(events)
    return {"reference": ref_peak if cfg.use_peft else 0, "update": update_peak, "bucket": bucket_bytes,
            "workspace": max(ref_workspace if cfg.use_peft else 0, update_workspace, merge_workspace),
            "merge": merge_peak, "merge_held": max(held)}


if __name__ == "__main__":
    update.optimizer_step = named_optimizer_step  # grpo_update looks it up at each call
    torch.set_num_threads(1)
    for name, spec in json.loads(sys.argv[1]).items():
        build(spec["model"], spec["shape"])
        print(json.dumps({"name": name, **measure(spec)}), flush=True)
