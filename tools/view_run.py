"""A run's report.html, during or after the run (make demo writes it at its end): simple_grpo/run/report.py's page.

    python tools/view_run.py runs/NAME                 # -> runs/NAME/report.html
    python tools/view_run.py runs/NAME --out r.html --completions_per_step 8 --steps_shown 20
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# noqa: E402 below - these imports come after the path fix that lets the script import them
from simple_grpo.flags import parse_flags  # noqa: E402
from simple_grpo.run.report import ViewConfig, write_report  # noqa: E402


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-"):  # the run directory as the first, positional argument
        argv = ["--run_dir", *argv]
    cfg = parse_flags(ViewConfig, __doc__, argv)
    if not cfg.run_dir:
        raise SystemExit("give the run's directory: python tools/view_run.py runs/NAME")
    return write_report(cfg.run_dir, cfg.out, completions_per_step=cfg.completions_per_step,
                        steps_shown=cfg.steps_shown)


if __name__ == "__main__":
    main()
