"""Which batch goes where in grpo_vllm_one.py's pipeline: the policy version that samples a batch (the
staleness bound), which worker makes a rank's batch, the run_id a batch travels under, and
WorkerSchedule, a worker's weights and batch numbers (its docstring has the timeline)."""
import queue
import time

from simple_grpo.generation.weight_sync import receive_weights


def sampling_version(batch_index, cfg):
    """The policy version that samples a rank's batch number batch_index (0, 1, ...; trained at step
    batch_index + 1): the oldest the staleness bound allows (versions come every sync_every steps).
    Fixed, so that a seed repeats its run."""
    oldest = max(batch_index - cfg.max_policy_lag, 0)
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

    Version v is the weights after trainer step v (0: the starting model). The worker set numbers its
    batches b = 0, 1, 2, ... (batch_index); with n ranks, batch b is rank b % n's batch number b // n,
    trained at step b // n + 1 and sampled by exactly sampling_version(b // n), the oldest the staleness
    bound --max_policy_lag allows, so a seed repeats its run however fast each process is. With the
    defaults (--sync_every 1, --max_policy_lag 1, one rank, one worker, so b // n = b):

        trainer step | trains batch | sampled by | meanwhile the worker samples | with
        (start-up)   |              |            | batch 0                      | version 0
        1            | 0            | version 0  | batch 1                      | version 0
        2            | 1            | version 0  | batch 2                      | version 1 (sent after step 1)
        3            | 2            | version 1  | batch 3                      | version 2
        s >= 2       | s - 1        | version s-2| batch s                      | version s - 1

    so the weights sent after step s sample the batch trained at step s + 2 (in general, with L =
    --max_policy_lag and k = --sync_every, the k batches trained at steps s + L + 2 - k to s + L + 1,
    for each s > 0 that is a multiple of k). The worker waits while its
    weights are older than the bound allows; weights newer than the next batch's version are held back
    until that batch is sampled; older ones (--gen_workers > 1: another worker's batch took them) are
    passed over unloaded. With --regroup the worker neither waits nor holds weights back (the
    regrouping server bounds the staleness). A ("resume", batch_index, draws) message moves the worker to a
    checkpoint's batch number and data position (the problem draws before it are replayed, not sampled)."""

    def __init__(self, cfg, llm, channels, n_ranks, first_batch_index, draw):
        self.cfg, self.llm, self.channels, self.n, self.draw = cfg, llm, channels, n_ranks, draw
        self.version = None if cfg.resume else 0  # of the loaded weights; None: the checkpoint's are on their way
        self.batch_index, self.draws = first_batch_index, 0  # the next batch's number; problem draws so far
        self.held, self.shared, self.load_s, self.waiting_since = None, {}, 0.0, None

    def draw_problems(self):
        """The next batch's problems: draw() (the worker's own random draw), counted in draws, the data
        position a checkpoint keeps."""
        problems = self.draw()
        self.draws += 1
        return problems

    def take_weights_or_wait(self):
        """One round of the worker's exchange with the trainer; True when the next batch may be sampled now.

        Takes the next message (waiting up to 1 s where the next batch's weights are due and not loaded)
        and acts on it: weights are loaded into vLLM (or held back while too new for the next batch, or
        passed over unloaded when too old); ("resume", batch_index, draws) moves the worker to a
        checkpoint's batch number and replays its problem draws. Ends the run (SystemExit) when the weights
        it waits for have not come in --data_timeout. False when it loaded weights or resumed (ask again)
        or must wait."""
        cfg, channels = self.cfg, self.channels
        # the next batch's lag, were it sampled now
        lag = None if self.version is None else self.batch_index // self.n - self.version
        must_wait = lag is None or (not cfg.regroup and lag > cfg.max_policy_lag)
        message, self.held = self.held, None  # weights held back before the last batch come first
        if message is None:
            try:
                message = channels.weights.get(timeout=1.0) if must_wait else channels.weights.get_nowait()
            except queue.Empty:
                pass
        if message is not None and message[0] == "weights" and self.version is not None and not cfg.regroup:
            due = sampling_version(self.batch_index // self.n, cfg)  # the version that samples the next batch
            if message[1] > due:
                message, self.held = None, message  # too new for the next batch: loaded once it is sampled
            elif message[1] < due:  # too old: another worker's batch was sampled with it
                channels.loaded.value, message = message[1], None  # passed over, never loaded: its buffer is free
        self.waiting_since = (self.waiting_since or time.time()) if must_wait and message is None else None
        if self.waiting_since is not None and time.time() - self.waiting_since > cfg.data_timeout:
            needed = self.batch_index // self.n - cfg.max_policy_lag
            raise SystemExit(f"generation worker: no new weights from the trainer in {cfg.data_timeout:.0f} s "
                             f"(it has version {self.version}, needs {needed})")
        if message is not None and message[0] == "resume":  # continue at the checkpoint's batch and data
            _, self.batch_index, self.draws = message
            for _ in range(self.draws):  # the draws the checkpoint's batches took
                self.draw()
        elif message is not None:  # the buffers (once), or weights to load before sampling more
            t0 = time.time()
            if (version := receive_weights(self.llm, message, self.shared, channels.loaded)) is not None:
                self.version, self.load_s = version, time.time() - t0
        return message is None and not must_wait

    def sampled(self, kept):
        """After a batch: the next number is this worker's next one if any group was kept (else it samples again)."""
        self.batch_index += self.cfg.gen_workers if kept else 0
