"""grpo_vllm_one.py's generation flags: where vLLM runs, how many workers, how stale a batch may be."""
from dataclasses import dataclass

from simple_grpo.flags import flag


@dataclass
class GenerationConfig:
    SECTIONS = {"gen_device": "the generation worker (vLLM)"}
    gen_device: int = flag(-1, "vLLM's first GPU as nvidia-smi numbers it; -1: the first no trainer rank uses")
    gen_tp: int = flag(1, "vLLM tensor-parallel size; only 1: the weight sync reaches one in-process vLLM (more "
                          "GPUs for sampling: --gen_workers K, each worker on a GPU of its own)")
    gen_every: int = flag(0, "one generation worker per this many trainer ranks (0: one per node)")
    gen_workers: int = flag(1, "generation workers (vLLM engines) per trainer: each on GPU(s) of its own, or pinned to "
                               "--gen_threads CPU cores")
    gen_threads: int = flag(1, "CPU machines: cores for each worker's vLLM (worker 0: the last ones, 1: those before)")
    gen_compile: bool = flag(False, "CPU machines: torch.compile vLLM's model (a slower start, faster sampling; "
                                    "on a GPU vLLM always compiles)")
    gen_memory: float = flag(0.0, "vLLM's gpu_memory_utilization; 0: 0.9 on a GPU of its own, 0.3 beside the trainer")
    max_model_len: int = flag(512, "vLLM's context length: prompt + completion")
    tis_cap: float = flag(2.0, "capped importance sampling (TIS): each token weighted by min(pi_old / pi_vLLM, cap); "
                                "0: no weights, vLLM's log-probs are pi_old (the ratio's denominator) instead")
    sync_every: int = flag(1, "optimizer steps between weight syncs to the worker")
    max_policy_lag: int = flag(1, "the worker waits rather than sample with weights older than this")
    regroup: bool = flag(False, "regroup_ver/: upload all groups; the regrouping server serves mixed-reward ones")
    max_completions: int = flag(0, "stop once the worker has generated this many completions (0: run all steps)")
    startup_timeout: float = flag(1200.0, "seconds the generation worker may take to start vLLM (load, compile)")
    startup_order: str = flag("auto", "auto: where vLLM shares a GPU with the trainer, the trainer loads its model "
                                      "once vLLM is up (vLLM sizes its cache from the GPU's free memory); "
                                      "vllm_first: always so; together: never wait")
    data_timeout: float = flag(600.0, "seconds to wait for a batch once vLLM is up (the worker: for new weights)")

    def __post_init__(self):
        if self.gen_tp != 1:  # tensor-parallel vLLM would pickle load_weights' iterator to its processes: it cannot
            raise SystemExit(f"--gen_tp {self.gen_tp}: grpo_vllm_one.py syncs weights only into a vLLM of one GPU "
                             "(--gen_tp 1). For more sampling, run --gen_workers K: K one-GPU vLLM workers, each with "
                             "its own copy of the weights; for a model too big for one GPU, vLLM needs a larger GPU")
        if self.startup_order not in ("auto", "vllm_first", "together"):
            raise SystemExit(f"unknown --startup_order {self.startup_order!r}: use auto, vllm_first or together")
        if self.max_policy_lag < self.sync_every - 1:
            raise SystemExit(f"--max_policy_lag {self.max_policy_lag} < --sync_every - 1 = {self.sync_every - 1}: the "
                             "worker would wait for weights the trainer cannot make without its batches")
