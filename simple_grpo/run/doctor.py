"""The run doctor: plain-word warnings when a run looks alive but is not learning. A rule speaks when its condition
starts, on the console and as a line in metrics.jsonl; the --doctor_* flags set when, and --stop_on RULES
(e.g. no_signal,kl) stops the run when one of them fires."""
import json
from collections import Counter

from tqdm import tqdm

from simple_grpo.run.disk_guard import append_lines
from simple_grpo.run.metrics import is_number

RULES = ("no_signal", "kl", "entropy", "truncated", "mismatch", "ratio", "tis")  # each one's --doctor_* flags say when
GAP_OUTLIER = 1.0  # nats: a token whose sampler and trainer log-probs differ by more is no precision noise


def sampler_gap_details(completion_ids, loss_mask, trainer_logps, sampler_logps):
    """The gap between vLLM's and the trainer's log-probs over one batch's kept tokens (each argument (Q*G, C)): its
    mean and largest, the completions holding a token off by more than GAP_OUTLIER, and the largest's token. The
    masks keep only tokens vLLM generated (grpo_math.completion_mask's lengths), so each kept one has its log-prob;
    a batch that keeps none has no largest gap."""
    kept = loss_mask.bool()
    gap = ((trainer_logps - sampler_logps).abs()).masked_fill(~kept, 0.0)
    details = {"sampler_gap_mean": float(gap.sum() / kept.sum().clamp(min=1)),
               "sampler_gap_rows": int((gap > GAP_OUTLIER).any(1).sum())}
    if kept.any():
        row, pos = divmod(int(gap.argmax()), gap.size(1))
        details.update(sampler_gap_max=float(gap.max()), sampler_gap_token=int(completion_ids[row, pos]),
                       sampler_gap_pos=pos, sampler_gap_sampler_logp=float(sampler_logps[row, pos]),
                       sampler_gap_trainer_logp=float(trainer_logps[row, pos]))
    return details


def parse_stop_on(text):
    """--stop_on "no_signal,kl" -> {"no_signal", "kl"}; an unknown name is an error naming the known ones."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = names - set(RULES)
    if unknown:
        raise SystemExit(f"unknown --stop_on rule(s) {sorted(unknown)}: use any of {', '.join(RULES)}")
    return names


def batch_summary(rewards, scores, texts, has_signal):
    """One batch's figures for the doctor, JSON-safe. rewards (Q*G,); scores, texts [Q*G]; has_signal (Q,)."""
    return {"groups": len(has_signal), "groups_with_signal": int(has_signal.sum()),
            "rewards": [round(r, 3) for r in rewards.tolist()],
            "sample": {"completion": texts[0], "scores": scores[0]}}


def mean(values):
    return sum(values) / len(values) if values else 0.0


def shorten(text, n=160):
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + "..."


class RunDoctor:
    """batch() takes each batch_summary, step() each step record; both return a --stop_on rule's message or None."""

    def __init__(self, cfg, metrics_path):
        self.cfg, self.metrics_path = cfg, metrics_path
        self.stop_on = parse_stop_on(cfg.stop_on)
        self.active = set()  # rules whose condition holds now (each speaks when it starts)
        self.silent = []  # the summaries of the latest batches in a row with no group with signal
        self.rows = []  # the step records so far

    def batch(self, summary, step):
        """no_signal: a batch whose groups' rewards are each all alike teaches nothing."""
        self.silent = [] if summary["groups_with_signal"] else (self.silent + [summary])[-self.cfg.doctor_window:]
        firing = len(self.silent) >= self.cfg.doctor_window
        return self.report("no_signal", firing, step, self.no_signal_message)

    def no_signal_message(self):
        rewards = [r for s in self.silent for r in s["rewards"]]
        seen = ", ".join(f"{value:g} x{count}" for value, count in Counter(rewards).most_common(4))
        sample = self.silent[-1]["sample"]
        parts = " + ".join(f"{name} {value:g}" for name, value in sample["scores"].items() if name != "reward")
        return (f"no group had reward variance in the last {len(self.silent)} batches "
                f"({sum(s['groups'] for s in self.silent)} prompts): every advantage is 0, GRPO learns nothing. "
                f"Rewards seen: {seen}. A completion: {json.dumps(shorten(sample['completion']))} scored "
                f"{sample['scores']['reward']:g} ({parts}). Likely cause: the model never earns the reward, or all "
                "its answers to a question score alike. Try: python tools/probe.py --model "
                f"{self.cfg.model} to see its pass rate; warm-start the model on the answer format (tools/warm_start.py), "
                "change --reward_funcs/--reward_weights/"
                "--reward_file, or raise --num_generations/--temperature")

    def step(self, record):
        """The other rules, on the step records so far. A step with no update logs kl and ratio_mean as None (not
        measured): it is left out of their means, and a rule with nothing measured keeps its state."""
        cfg, step, window = self.cfg, record["step"], self.cfg.doctor_window
        self.rows.append(record)
        recent, stops, kl = self.rows[-window:], [], record.get("kl", 0.0)
        if is_number(kl):
            before = [r["kl"] for r in self.rows[-window - 1:-1] if is_number(r.get("kl", 0.0))]
            jumped = kl > 1.0 and before and kl > cfg.doctor_kl_jump * mean(before)
            stops.append(self.report("kl", kl > cfg.doctor_kl_max or jumped, step,
                                     lambda: self.kl_message(kl, mean(before))))
        entropies = [r["entropy"] for r in self.rows if "entropy" in r]
        start, now = mean(entropies[:window]), mean(entropies[-window:])
        collapsing = len(entropies) >= 2 * window and now < cfg.doctor_entropy_drop * start
        stops.append(self.report("entropy", collapsing, step, lambda: self.entropy_message(start, now)))
        cut = mean([r.get("truncated_frac", 0.0) for r in recent])
        context_cut = mean([r.get("context_cut_frac", 0.0) for r in recent])  # grpo_vllm_one's: ended by vLLM's context
        # too many cut off over the window; any cut by the context at once (a setting causes it, not the policy)
        too_many = len(recent) == window and cut > cfg.doctor_truncated_max
        stops.append(self.report("truncated", too_many or context_cut > 0, step,
                                 lambda: self.truncated_message(cut, context_cut, len(recent))))
        gaps = [r["sampler_gap_mean"] for r in recent if "sampler_gap_mean" in r]
        mismatch = bool(gaps) and mean(gaps) > cfg.doctor_gap_max
        stops.append(self.report("mismatch", mismatch, step, lambda: self.mismatch_message(record, gaps)))
        if is_number(record.get("ratio_mean", 1.0)):
            ratios = [r.get("ratio_mean", 1.0) for r in recent if is_number(r.get("ratio_mean", 1.0))]
            stops.append(self.report("ratio", abs(mean(ratios) - 1) > cfg.doctor_ratio_band, step,
                                     lambda: self.ratio_message(record, ratios)))
        capped = [r["is_capped_frac"] for r in recent if is_number(r.get("is_capped_frac"))]  # TIS on (--tis_cap)
        collapsed = len(capped) == window and mean(capped) > cfg.doctor_tis_capped_max
        stops.append(self.report("tis", collapsed, step, lambda: self.tis_message(record, capped, recent)))
        return next((stop for stop in stops if stop), None)

    def tis_message(self, record, capped, recent):
        """Most tokens' TIS weights at the cap: how many, this step's weights, and the policy lags the window saw."""
        lags = [lag for r in recent for lag in r.get("batch_lags", [r.get("policy_lag", 0)])]
        return (f"{mean(capped):.0%} of the tokens' TIS weights min(pi_old / pi_vLLM, --tis_cap {self.cfg.tis_cap:g}) "
                f"sat at the cap over the last {len(capped)} steps (this step: mean "
                f"{record.get('is_weight_mean', 0):.3g}, min {record.get('is_weight_min', 0):.3g}, max "
                f"{record.get('is_weight_max', 0):.3g}; policy lag mean {mean(lags):.2g}, max {max(lags, default=0)}): "
                "the policy that sampled is far from pi_old, the correction is mostly the cap itself, and the gradient "
                "is biased where it binds. Lower --max_policy_lag, or --lr; at lag 0 or 1 the sampler itself differs "
                "(see the mismatch rule, --dtype)")

    def entropy_message(self, start, now):
        return (f"policy entropy fell to {now:.3g} nats per token, {now / start:.0%} of its {start:.3g} over the "
                f"first {self.cfg.doctor_window} steps: the policy is collapsing onto a few answers, exploration ends "
                "and groups turn all-alike. Try a lower --lr, a higher --beta or --temperature, or clip-higher "
                "(--epsilon_high 0.28)")

    def truncated_message(self, cut, context_cut, steps):
        cfg = self.cfg
        text = (f"{cut:.0%} of the completions of the last {steps} step{'s' if steps > 1 else ''} were cut off "
                "without a stop token, their answers scored unfinished")
        if cut - context_cut > 1e-9:
            text += (f"; {cut - context_cut:.0%} at --max_new_tokens {cfg.max_new_tokens} (raise it, or reward "
                     "shorter answers)")
        if context_cut > 0:
            text += (f"; {context_cut:.0%} at the end of vLLM's context, --max_model_len {cfg.max_model_len} tokens "
                     "of prompt and completion, before --max_new_tokens (raise --max_model_len: the run's start said "
                     "which prompts leave too little room)")
        return text + ". --mask_truncated_completions keeps cut-off completions out of the loss"

    def ratio_message(self, record, ratios):
        return (f"the importance ratio pi/pi_old averaged {mean(ratios):.3g} over the last {len(ratios)} updates "
                f"(this step: min {record.get('ratio_min', 1.0):.3g}, max {record.get('ratio_max', 1.0):.3g}): the "
                "policy moves far from the one that sampled within a step, and the clip discards much of the "
                "gradient. Lower --lr or --num_iterations; with vLLM, --max_policy_lag 0")

    def mismatch_message(self, record, gaps):
        """What the sampler and the trainer disagree on: the window's mean gap, this step's completions with an
        outlier token and its largest gap (token id, vLLM's and the trainer's log-probs), and the likely cause."""
        text = (f"vLLM's log-probs differ from the trainer's by {mean(gaps):.3g} per token on average over the last "
                f"{len(gaps)} step{'s' if len(gaps) > 1 else ''} (this step's largest {record.get('sampler_gap_max', 0.0):.3g})")
        if record.get("sampler_gap_rows"):
            text += (f"; this step {record['sampler_gap_rows']} completions hold a token off by more than "
                     f"{GAP_OUTLIER:g} nat, the largest at token id {record['sampler_gap_token']} (position "
                     f"{record['sampler_gap_pos']}): vLLM {record['sampler_gap_sampler_logp']:.3g}, trainer "
                     f"{record['sampler_gap_trainer_logp']:.3g}")
        return text + (": the sampler is not running the policy the trainer trains. Check that both use the same "
                       "--dtype and that weights reach vLLM (weights_load_s in metrics.jsonl); lower --max_policy_lag; "
                       "keep --tis_cap on")

    def kl_message(self, kl, recent):
        cfg, n = self.cfg, sum(is_number(r.get("kl", 0.0)) for r in self.rows)  # the updates so far
        if n <= 3:
            usual = ("LoRA adapters on a real pretrained model train at about 1e-4 (SmolLM2-135M: 2e-4)"
                     if getattr(cfg, "use_peft", False) else
                     "a real pretrained model trains at about 1e-6 in full, 1e-4 as LoRA adapters (--use_peft)")
            return (f"KL {kl:.3g} after {n} update{'s' if n > 1 else ''}: the learning rate is likely too high for "
                    f"this model (--lr {cfg.lr:g}; {usual})")
        if kl <= cfg.doctor_kl_max:
            return (f"KL to the reference jumped to {kl:.3g} from a recent mean of {recent:.3g}: one update moved "
                    "the policy far (see grad_norm). Lower --lr, or raise --beta")
        return (f"KL to the reference is {kl:.3g} (> --doctor_kl_max {cfg.doctor_kl_max:g}): the policy has drifted "
                "far from the reference and may be exploiting the reward. Lower --lr, or raise --beta")

    def report(self, rule, firing, step, message):
        """Speak when `rule` starts firing; returns the stop message if it is a --stop_on rule."""
        if not firing:
            self.active.discard(rule)
        if not firing or rule in self.active:
            return None
        self.active.add(rule)
        text = message()
        tqdm.write(f"run doctor [{rule}] at step {step}: {text}")
        append_lines(self.metrics_path, [json.dumps({"step": step, "warning": rule, "message": text}) + "\n"])
        return f"run doctor stopped the run (--stop_on {rule}): {text}" if rule in self.stop_on else None
