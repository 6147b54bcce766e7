"""simple_grpo: the full trainer, train.py (python -m simple_grpo.train: the lesson's step with every feature;
nothing here imports it), and its mechanics, a folder for each part of the three-process picture: task/
(problems, prompts, rewards), trainer/ (flags, the GRPO update, DeepSpeed, the memory plan), generation/
(samplers, workers, the weight channel), run/ (run directory, logs, checkpoints, doctor); and shared by all:
flags.py, protocol.py (the wire format, regroup_ver/'s server's flags, the fingerprint), http_server.py
(regroup_ver/'s server's HTTP side), devices.py, rollouts.py, evaluation.py. The lessons, grpo_vllm_one.py and
ref_server.py, stand alone and copy what they need of it (tests hold the copies equal). Imports go down (scripts
import this package, it imports grpo_math.py and triton_loss/, never a script), and the generation side and the
trainer side never import each other (tests/test_layering.py).
"""
