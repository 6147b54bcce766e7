"""simple_grpo: the mechanics under the four files a student reads (grpo_math.py, grpo_train.py, grpo_vllm_one.py,
ref_server.py), and train.py on top, the full trainer (python -m simple_grpo.train; nothing here imports it); a folder
for each part of the three-process picture: task/ (problems, prompts, rewards), trainer/ (flags, the GRPO update,
DeepSpeed, the memory plan), generation/ (samplers, workers, the weight channel), run/ (run directory, logs,
checkpoints, doctor); and shared by all: flags.py, protocol.py (the wire format, the ref server's flags, its
fingerprint), http_server.py (the ref server's HTTP side), devices.py, rollouts.py, evaluation.py. Imports go down
(scripts import this package, it imports grpo_math.py and triton_loss/, never a script), and the generation side and
the trainer side never import each other (tests/test_layering.py).
"""
