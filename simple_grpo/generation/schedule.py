"""Which batch goes where in grpo_vllm_one.py's pipeline: the policy version that samples a batch (the
staleness bound), which worker makes a rank's batch, the run_id a batch travels under, and
WorkerSchedule, a worker's weights and batch numbers (its docstring has the timeline)."""
import queue
import time

from simple_grpo.generation.weight_sync import receive_weights


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



class WorkerSchedule:
    """A generation worker's weights and batch numbers: which version samples which batch, which weights
    are loaded, held back or passed over, and when the worker waits (grpo_vllm_one.py's gen_worker).

    Version v is the weights after trainer step v (0: the starting model). Batch b (numbered per worker
    set, b // n for n ranks) is trained at step b + 1 and sampled by exactly sampling_version(b), the
    oldest the staleness bound --max_policy_lag allows, so a seed repeats its run however fast each
    process is. With the defaults (--sync_every 1, --max_policy_lag 1, one rank, one worker):

        trainer step | trains batch | sampled by | meanwhile the worker samples | with
        (start-up)   |              |            | batch 0                      | version 0
        1            | 0            | version 0  | batch 1                      | version 0
        2            | 1            | version 0  | batch 2                      | version 1 (sent after step 1)
        3            | 2            | version 1  | batch 3                      | version 2
        s >= 2       | s - 1        | version s-2| batch s                      | version s - 1

    so the weights sent after step s sample the batch trained at step s + 2. The worker waits while its
    weights are older than the bound allows; weights newer than the next batch's version are held back
    until that batch is sampled; older ones (--gen_workers > 1: another worker's batch took them) are
    passed over unloaded. With --regroup the worker neither waits nor holds weights back (the
    regrouping server bounds the staleness). A ("resume", batch, draws) message moves the worker to a
    checkpoint's batch number and data position (skip_draws replays the problem draws)."""

    def __init__(self, cfg, llm, channels, n_ranks, first_batch, skip_draws):
        self.cfg, self.llm, self.channels, self.n, self.skip_draws = cfg, llm, channels, n_ranks, skip_draws
        self.version = None if cfg.resume else 0  # of the loaded weights; None: the checkpoint's are on their way
        self.batch, self.draws = first_batch, 0  # the next batch's number; problem draws so far (data position)
        self.held, self.shared, self.load_s, self.waiting_since = None, {}, 0.0, None

    def ready(self):
        """Take what came from the trainer (waiting up to 1 s when the worker must wait); True when the next
        batch may be sampled now. Stops the run when the weights it waits for do not come in --data_timeout."""
        cfg, channels = self.cfg, self.channels
        lag = None if self.version is None else self.batch // self.n - self.version  # of the next batch, if sampled now
        must_wait = lag is None or (not cfg.regroup and lag > cfg.max_policy_lag)
        message, self.held = self.held, None  # weights held back before the last batch come first
        if message is None:
            try:
                message = channels.weights.get(timeout=1.0) if must_wait else channels.weights.get_nowait()
            except queue.Empty:
                pass
        if message is not None and message[0] == "weights" and self.version is not None and not cfg.regroup:
            due = sampling_version(self.batch // self.n, cfg)  # the version that samples the next batch
            if message[1] > due:
                message, self.held = None, message  # too new for the next batch: loaded once it is sampled
            elif message[1] < due:  # too old: another worker's batch was sampled with it
                channels.loaded.value, message = message[1], None  # passed over, never loaded: its buffer is free
        self.waiting_since = (self.waiting_since or time.time()) if must_wait and message is None else None
        if self.waiting_since is not None and time.time() - self.waiting_since > cfg.data_timeout:
            raise SystemExit(f"generation worker: no new weights from the trainer in {cfg.data_timeout:.0f} s "
                             f"(it has version {self.version}, needs {self.batch // self.n - cfg.max_policy_lag})")
        if message is not None and message[0] == "resume":  # continue at the checkpoint's batch and data
            _, self.batch, self.draws = message
            self.skip_draws(self.draws)
        elif message is not None:  # the buffers (once), or weights to load before sampling more
            t0 = time.time()
            if (version := receive_weights(self.llm, message, self.shared, channels.loaded)) is not None:
                self.version, self.load_s = version, time.time() - t0
        return message is None and not must_wait

    def sampled(self, kept):
        """After a batch: the next number is this worker's next one if any group was kept (else it samples again)."""
        self.batch += self.cfg.gen_workers if kept else 0
