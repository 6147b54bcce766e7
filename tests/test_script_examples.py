"""The example commands in grpo_train.py's and simple_grpo/train.py's docstrings parse as written, and each trainer that
asks the reference server for its KL term is paired with a server that holds its own --model (the fingerprint
check would stop a pair that is not)."""
import shlex

import pytest

import grpo_train
import ref_server
import simple_grpo.train
from simple_grpo.flags import parse_flags
from simple_grpo.trainer.config import default_ref_url


def example_commands(doc):
    """[(script, flags)] for the docstring's lines that run python or deepspeed, comments and '&' left out; a
    module run with -m (deepspeed: --module) is named by its dotted name."""
    commands = []
    for line in doc.replace("\\\n", " ").splitlines():  # a line ending in a backslash goes on
        if not line.strip().startswith(("python ", "deepspeed ")):
            continue
        words = shlex.split(line.split("#")[0].replace("&", " "))
        script = next(i for i, word in enumerate(words) if word.endswith(".py") or word in ("-m", "--module"))
        script += words[script] in ("-m", "--module")
        commands.append((words[script], words[script + 1:]))
    return commands


@pytest.mark.parametrize("module, trainer", [(grpo_train, "grpo_train.py"), (simple_grpo.train, "simple_grpo.train")])
def test_the_docstrings_example_commands_parse_and_each_trainer_is_served_its_own_model(module, trainer):
    commands = example_commands(module.__doc__)
    assert any(script == trainer for script, _ in commands) and any(s == "ref_server.py" for s, _ in commands)
    server = None  # the server the lines above started
    for script, flags in commands:
        if script == "ref_server.py":
            server = ref_server.parse_flags(flags)
            continue
        assert script == trainer, f"{trainer}'s docstring runs {script}"
        # grpo_train.py parses its own flags (it stands alone): a full-trainer flag would stop it here
        cfg = grpo_train.parse_flags(flags) if module is grpo_train else parse_flags(module.Config, args=flags)
        cfg.ref_url = cfg.ref_url or default_ref_url(cfg)[0]
        if cfg.beta != 0 and cfg.ref_url and not getattr(cfg, "use_peft", False):
            assert server is not None, f"`{trainer} {' '.join(flags)}` needs a ref server started above it"
            assert server.model == cfg.model, f"`{trainer} {' '.join(flags)}` is served {server.model}"
