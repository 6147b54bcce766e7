"""What the generation worker is doing, as the trainer sees it: no silent wait, and none without a deadline.

grpo_vllm_one's worker sends a status message for every batch it samples, trained or dropped
(("ready", seconds) once vLLM is up, then ("batch", run/doctor.py's batch_summary + counts)). While the
trainer waits for its next batch, WorkerProgress turns them into the progress bar's text (what
the wait is for, batches made and dropped, the last rewards), hands each batch to the run doctor
(a model that never earns its reward is named within --doctor_window batches), and ends the wait
with a message naming what never came: vLLM not up after --startup_timeout, or no trainable batch
--data_timeout seconds after the wait began (or vLLM came up).
"""
import queue
import time

from tqdm import tqdm


class WorkerProgress:
    def __init__(self, status_queue, cfg, doctor):
        self.queue, self.cfg, self.doctor = status_queue, cfg, doctor
        self.started, self.ready_at = time.time(), None
        # batches sampled; of them, with no group kept (and how many of the latest in a row); groups sent on
        self.batches, self.dropped, self.dropped_in_row, self.posted = 0, 0, 0, 0
        self.last = None  # the latest batch's summary

    def update(self, step):
        """Take the worker's new messages; the doctor reads each batch. Returns the doctor's stop message, or None."""
        stop = None
        while True:
            try:
                kind, body = self.queue.get_nowait()
            except queue.Empty:
                return stop
            if kind == "ready":
                self.ready_at = time.time()
                tqdm.write(f"generation worker: vLLM ready after {body:.0f} s")
                continue
            self.batches, self.posted, self.last = self.batches + 1, self.posted + body["posted"], body
            self.dropped += body["posted"] == 0
            self.dropped_in_row = self.dropped_in_row + 1 if body["posted"] == 0 else 0
            if self.doctor is not None:
                stop = self.doctor.batch(body, step) or stop

    def describe(self, step, waited_s):
        """The progress bar's text while the trainer waits for the batch of `step`."""
        if self.ready_at is None:
            return (f"waiting for the generation worker to start vLLM ({time.time() - self.started:.0f} s, "
                    f"gives up after {self.cfg.startup_timeout:.0f} s)")
        text = f"waiting for batch {step} ({waited_s:.0f} s): worker made {self.batches} batches"
        if self.dropped:
            text += f", {self.dropped} dropped whole (all groups all-alike)"
        if self.last is not None:
            text += f", last reward mean {sum(self.last['rewards']) / len(self.last['rewards']):.2f}"
        return text

    def check_deadline(self, waited_s):
        """Stop the run, naming what never came, when a wait has gone on too long."""
        now, cfg = time.time(), self.cfg
        if self.ready_at is None:
            if now - self.started > cfg.startup_timeout:
                raise SystemExit(f"the generation worker has not started vLLM in {cfg.startup_timeout:.0f} s "
                                 f"(model {cfg.model}): see its log above; a large model may need a longer "
                                 "--startup_timeout")
            return
        if now - max(now - waited_s, self.ready_at) <= cfg.data_timeout:
            return
        if self.batches == 0:
            what = "the worker has sampled no batch at all since vLLM started: see its log above"
        elif self.dropped_in_row:
            what = (f"the worker's last {self.dropped_in_row} batches (of {self.batches}) were all dropped: no group "
                    f"had reward variance (rewards in the last: {sorted(set(self.last['rewards']))[:5]}); see the run "
                    "doctor's no_signal warning above")
        else:
            what = (f"the worker sampled {self.batches} batches and sent {self.posted} groups"
                    + (", but the ref server returned none for this step: see its log" if cfg.beta != 0 or cfg.regroup
                       else ""))
        raise SystemExit(f"no trainable batch came in {cfg.data_timeout:.0f} s (--data_timeout): {what}")
