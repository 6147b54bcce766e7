"""The regrouping reference server: pools answers per question, serves groups with mixed rewards.

    python regroup_ver/ref_server_regroup.py            # 127.0.0.1:59875, tiny default model
    python regroup_ver/grpo_regroup.py                  # the trainer that feeds it (see README.md here)

When all G answers to a question are right, or all wrong, every advantage is 0 and the
group teaches nothing. The plain ref_server.py never sees such groups (trainers drop them).
Here generators upload every group, and the server keeps, per question, a pool of answers
(completion, reward, policy version, behaviour log-probs). When a question's pool holds G
answers whose rewards are not all equal, it serves them as one group: advantages over that
group, reference log-probs added, and each answer keeps its own behaviour log-probs, so the
trainer's ratio exp(logp - old_logp) corrects and clips older answers like any off-policy data.

The price is staleness: a pooled answer may wait for its question to be asked again. Answers
older than --max_policy_lag versions are evicted and never served; pools are capped in size
and in number, so memory stays bounded. Uploads, checks, tokens and /health are ref_server.py's
(simple_grpo/reference/).

The advantages it serves are the trainer's to choose: start it with the trainer's --scale_rewards,
--advantage_eps and --prompt_format (the last, with --model, gives the one stop set answers are cut at).
An upload whose advantages or stop tokens say the trainer used others is refused (HTTP 400, naming the
flag), and --scale_rewards batch, an std over the trainer's whole batch, which the server never sees, too.
"""
import os
import queue
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import bottle
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the main code, one level up
from grpo_math import completion_mask, group_advantages  # noqa: E402
from simple_grpo.flags import flag, parse_flags  # noqa: E402
from simple_grpo.generation.vllm_sampler import NO_LOGP, generated_lengths  # noqa: E402
from simple_grpo.logprobs import load_reference, sequence_logps  # noqa: E402
from simple_grpo.protocol import ServerConfig, encode  # noqa: E402
from simple_grpo.http_server import (add_token_check_and_health, answer, check_exposure,  # noqa: E402
                                     read_rollout, serve, wait_seconds)
from simple_grpo.task.problems import stop_token_ids  # noqa: E402


@dataclass
class RegroupConfig(ServerConfig):
    num_generations: int = flag(8, "answers in a served group (the trainer's G)")
    max_policy_lag: int = flag(4, "answers this many versions older than the newest seen are evicted")
    pool_size: int = flag(32, "answers kept per question (the oldest go first)")
    max_questions: int = flag(2048, "questions pooled (the least recently answered go first)")
    max_ready: int = flag(16, "served groups waiting for trainers; /upload answers 503 beyond it")
    scale_rewards: str = flag("group", "the trainer's --scale_rewards: group or none (dr_grpo's); batch, an std over "
                                       "the trainer's whole batch, cannot be pooled (a served group is one question's)")
    advantage_eps: float = flag(1e-4, "the trainer's --advantage_eps: added to a served group's reward std")
    prompt_format: str = flag("chat", "the trainer's --prompt_format: with --model it gives the stop set "
                                      "(task/problems.py's stop_token_ids) pooled answers are cut at")


def check_config(cfg):
    """Stop with an error naming the flag the server cannot honour, before the model loads."""
    if cfg.scale_rewards == "batch":
        raise SystemExit("--scale_rewards batch: the regrouping server serves one question's group at a time and "
                         "never sees the trainer's batch; use group or none, on the server and the trainer alike")
    if cfg.scale_rewards not in ("group", "none"):
        raise SystemExit(f"unknown --scale_rewards {cfg.scale_rewards!r}: use group or none")
    if cfg.prompt_format not in ("chat", "raw"):
        raise SystemExit(f"unknown --prompt_format {cfg.prompt_format!r}: use chat or raw")


def check_upload(tensors, cfg, stop_ids, pad_token_id):
    """ValueError naming the flag where an upload shows that its trainer's flags are not this server's: its
    advantages (the generator's, grpo_math.group_advantages over the uploaded group) differ from ours by more
    than float32 noise (1e-5), or a completion goes on after a token of our stop set (the generator stops at
    its first stop token and pads after it)."""
    if "advantages" in tensors:
        rewards = tensors["rewards"].float()
        ours = group_advantages(rewards, rewards.numel(), scale_rewards=cfg.scale_rewards, eps=cfg.advantage_eps)
        if not torch.allclose(tensors["advantages"].float(), ours, rtol=1e-5, atol=1e-6):
            raise ValueError(f"the upload's advantages are not this server's (--scale_rewards {cfg.scale_rewards}, "
                             f"--advantage_eps {cfg.advantage_eps:g}): start ref_server_regroup.py with the trainer's "
                             "--scale_rewards and --advantage_eps")
    completion_ids = tensors["completion_ids"]  # (G, C)
    if ((completion_mask(completion_ids, stop_ids) == 0) & (completion_ids != pad_token_id)).any():
        raise ValueError(f"a completion goes on after a token of this server's stop set {stop_ids} (--prompt_format "
                         f"{cfg.prompt_format}, --model {cfg.model}): start ref_server_regroup.py with the trainer's "
                         "--prompt_format and --model")


class Pools:
    """Per (run, question): answers waiting to be served, each (completion_ids (C,), reward,
    version, sampler_logps (C,)) cut after its first stop token (stop_ids: the trainer's stop set,
    stop_token_ids). Call under the server's lock."""

    def __init__(self, cfg, stop_ids, pad_token_id):
        self.cfg, self.stop_ids, self.pad = cfg, stop_ids, pad_token_id
        self.pools = OrderedDict()  # key -> {"prompt_ids", "temperature", "answers": [...]}
        self.newest = 0  # the newest policy version seen: the age of an answer counts from it
        self.stats = {"answers_in": 0, "answers_served": 0, "answers_evicted": 0, "groups_formed": 0}

    def add(self, tensors, meta):
        """Pool an uploaded group's answers; returns the key of their question."""
        key = (meta.get("run_id"), tuple(tensors["prompt_ids"].tolist()))
        pool = self.pools.pop(key, None) or {"prompt_ids": tensors["prompt_ids"], "answers": []}
        pool["meta"] = meta  # the latest upload's: temperature, the generator's stats for the trainer's log
        self.pools[key] = pool  # now the most recently answered
        lengths = completion_mask(tensors["completion_ids"], self.stop_ids,
                                  lengths=generated_lengths(tensors["sampler_logps"])).sum(1).long().tolist()
        for i, n in enumerate(lengths):
            pool["answers"].append((tensors["completion_ids"][i, :n].clone(), float(tensors["rewards"][i]),
                                    meta.get("policy_version", 0), tensors["sampler_logps"][i, :n].clone()))
        self.stats["answers_in"] += len(lengths)
        if len(pool["answers"]) > self.cfg.pool_size:  # cap the pool: drop its oldest answers
            drop = len(pool["answers"]) - self.cfg.pool_size
            pool["answers"] = pool["answers"][drop:]
            self.stats["answers_evicted"] += drop
        while len(self.pools) > self.cfg.max_questions:  # cap the questions: drop the least recent
            self.stats["answers_evicted"] += len(self.pools.popitem(last=False)[1]["answers"])
        self.see_version(meta.get("policy_version", 0))
        return key

    def see_version(self, version):
        """A newer policy exists: evict answers more than max_policy_lag versions older."""
        if version <= self.newest:
            return
        self.newest = version
        for key in list(self.pools):
            answers = self.pools[key]["answers"]
            fresh = [a for a in answers if a[2] >= self.newest - self.cfg.max_policy_lag]
            self.stats["answers_evicted"] += len(answers) - len(fresh)
            if fresh:
                self.pools[key]["answers"] = fresh
            else:
                del self.pools[key]

    def take_group(self, key):
        """G answers of one question with mixed rewards, as a group to serve, or None. The group is
        the freshest answer of the rarest reward, then the freshest answers of other rewards, then
        the freshest of the rest: each group uses up one rare answer, so the pool yields as many
        mixed groups as it can (8 wrong answers and then 2 right of 8 more make two groups, not
        one). Served answers leave the pool."""
        pool, G = self.pools.get(key), self.cfg.num_generations
        if pool is None or len(pool["answers"]) < G:
            return None
        answers = sorted(pool["answers"], key=lambda a: -a[2])  # freshest first
        by_reward = {}
        for a in answers:
            by_reward.setdefault(a[1], []).append(a)
        if len(by_reward) < 2:
            return None  # all answers alike so far: wait for more
        rare = min(by_reward.values(), key=len)[0]
        chosen = [rare] + [a for a in answers if a[1] != rare[1]][:G - 1]
        chosen += [a for a in answers if a[1] == rare[1] and a is not rare][:G - len(chosen)]
        pool["answers"] = [a for a in pool["answers"] if not any(a is c for c in chosen)]
        self.stats["answers_served"] += G
        self.stats["groups_formed"] += 1
        C = max(a[0].numel() for a in chosen)
        rewards = torch.tensor([a[1] for a in chosen])
        versions = [a[2] for a in chosen]
        tensors = {"prompt_ids": pool["prompt_ids"],
                   "completion_ids": torch.stack([torch.nn.functional.pad(a[0], (0, C - a[0].numel()), value=self.pad)
                                                  for a in chosen]),
                   "rewards": rewards,  # advantages over the served group, with the trainer's flags
                   "advantages": group_advantages(rewards, G, scale_rewards=self.cfg.scale_rewards,
                                                 eps=self.cfg.advantage_eps),
                   "sampler_logps": torch.stack([torch.nn.functional.pad(a[3], (0, C - a[3].numel()), value=NO_LOGP)
                                                 for a in chosen])}  # past an answer's end: no log-prob
        meta = {**pool["meta"], "policy_version": min(versions), "policy_versions": versions}
        return tensors, meta

    def sizes(self):
        answers = [a for p in self.pools.values() for a in p["answers"]]
        return {"pool_questions": len(self.pools), "pool_answers": len(answers),
                "pool_bytes": sum(a[0].numel() * 8 + a[3].numel() * 4 for a in answers)}


def make_app(model, tokenizer, cfg: RegroupConfig):
    app = bottle.Bottle()
    todo, done = queue.Queue(), queue.Queue()  # formed groups -> ref log-probs -> trainers; max_ready bounds both
    stop_ids = stop_token_ids(tokenizer, cfg.prompt_format, cfg.model)  # the trainer's one stop set
    pools = Pools(cfg, stop_ids, tokenizer.pad_token_id)
    stats = {"groups_in": 0, "groups_taken": 0, "groups_stale": 0, "rejected": 0, "rejected_full": 0, "errors": 0}
    lock, started = threading.Lock(), time.time()
    add_token_check_and_health(app, cfg, stats)

    def ref_worker():
        while True:
            tensors, meta = todo.get()
            try:
                prompt = tensors["prompt_ids"].to(model.device)[None]  # (1, P): as ref_server.py's ref_worker
                tensors["ref_logps"] = sequence_logps(model, prompt, torch.ones_like(prompt),
                                                      tensors["completion_ids"].to(model.device),
                                                      meta.get("temperature", 1.0)).float().cpu()  # (G, C)
                done.put((meta["policy_version"], encode(tensors, meta)))
            except Exception as e:  # noqa: BLE001 - report, keep serving
                stats["errors"] += 1
                print(f"ref_worker: group dropped: {type(e).__name__}: {e}", file=sys.stderr)
    threading.Thread(target=ref_worker, daemon=True).start()

    @app.post("/upload")
    def upload():
        _, tensors, meta = read_rollout(cfg, model.config, stats)
        pooled = "rewards" in tensors and "sampler_logps" in tensors  # optional on the wire, needed to pool
        if not pooled or tensors["completion_ids"].size(0) > cfg.pool_size:
            stats["rejected"] += 1
            return answer(400, f"regroup uploads need rewards, sampler_logps (behaviour log-probs) and at most "
                               f"{cfg.pool_size} completions")
        try:
            check_upload(tensors, cfg, stop_ids, tokenizer.pad_token_id)
        except ValueError as e:
            stats["rejected"] += 1
            return answer(400, str(e))
        with lock:
            if todo.qsize() + done.qsize() >= cfg.max_ready:  # trainers are behind: generators wait
                stats["rejected_full"] += 1
                return answer(503, "enough groups ready: retry later")
            key = pools.add(tensors, meta)
            while (group := pools.take_group(key)) is not None:
                todo.put(group)
        stats["groups_in"] += 1
        return {"ok": True}

    @app.get("/get")
    def get():
        """The oldest formed group; ?policy_version=N tells the trainer's version, and groups with
        answers more than max_policy_lag older are dropped here rather than served."""
        try:
            version = int(bottle.request.query.get("policy_version") or 0)
        except ValueError:
            return answer(400, "policy_version must be an integer")
        with lock:
            pools.see_version(version)
        deadline = time.time() + wait_seconds()
        while True:
            try:
                oldest, body = done.get(timeout=max(deadline - time.time(), 0.01))
            except queue.Empty:
                return bottle.HTTPResponse(status=204)
            if oldest >= pools.newest - cfg.max_policy_lag:
                break
            stats["groups_stale"] += 1
        stats["groups_taken"] += 1
        bottle.response.content_type = "application/octet-stream"
        return body

    @app.get("/stats")
    def stats_():
        with lock:
            return {"forming": todo.qsize(), "ready": done.qsize(), "newest_version": pools.newest,
                    "uptime_s": round(time.time() - started, 1), **stats, **pools.stats, **pools.sizes()}

    return app


if __name__ == "__main__":
    from transformers import AutoTokenizer
    config = parse_flags(RegroupConfig, __doc__)
    check_config(config)
    check_exposure(config)
    serve(make_app(load_reference(config), AutoTokenizer.from_pretrained(config.model), config), config,
          name="regroup ref server")
