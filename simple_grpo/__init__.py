"""simple_grpo: the mechanics under the four files a student reads (grpo_math.py, grpo_train.py,
grpo_vllm_one.py, ref_server.py), grouped by the part of the three-process picture they serve:

    task/        what a run learns from: problems and prompts, rewards, the task flags
    trainer/     the trainers' flags and checks, the GRPO update, the DeepSpeed engine and config, the memory plan
    generation/  the samplers (vLLM, transformers), the worker processes, the weight channel, progress
    run/         the run directory and checkpoints, metrics, completions log, report, doctor, pre-flight, disk guard

and, shared by all: flags.py (dataclasses as command lines), protocol.py (the wire format, the ref server's flags),
http_server.py (the ref server's HTTP side), devices.py (which device each process uses), rollouts.py (rewards, kept
groups, the batch), evaluation.py (rates and completions).
Imports go down: the scripts import this package, it imports grpo_math.py and triton_loss/, never a script;
the generation side and the trainer side never import each other (tests/test_layering.py).
"""
