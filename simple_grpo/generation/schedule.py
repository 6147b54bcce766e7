"""Which batch goes where in grpo_vllm_one.py's pipeline: the policy version that samples a batch (the
staleness bound), which worker makes a rank's batch, and the run_id a batch travels under."""


def sampling_version(batch, cfg):
    """The policy version that samples a rank's batch-th batch: the oldest the staleness bound allows
    (versions come every sync_every steps). Fixed, so that a seed repeats its run."""
    oldest = max(batch - cfg.max_policy_lag, 0)
    return -(-oldest // cfg.sync_every) * cfg.sync_every


def stream_id(run_id, rank, world, cfg, worker):
    """The run_id a batch carries: the server hands each rank its own, and each worker's apart, so
    the groups of two batches never mix (regroup: any rank takes any group, each a whole group)."""
    if cfg.regroup:
        return run_id
    return run_id + (f"-{rank}" if world > 1 else "") + (f"-w{worker}" if cfg.gen_workers > 1 else "")


def batch_worker(step, rank, served, cfg):
    """Which worker makes the batch of `step` for `rank`: a worker set makes batches b = 0, 1, 2, ...
    in turn for its ranks `served` (b -> rank served[b % len(served)]), worker b % gen_workers."""
    return ((step - 1) * len(served) + served.index(rank)) % cfg.gen_workers

