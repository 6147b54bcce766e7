"""tools/view_run.py: the run report, read back from the file and rendered by a real browser.

    python -m pytest -q tests/test_view_run.py
    SAVE_SCREENSHOT=1 python -m pytest -q tests/test_view_run.py    # the screenshot -> docs/report_screenshot.png

The run is a real one (tests/data/example_run/: 60 GRPO steps on the tiny model, and completions the
probe sampled from its checkpoints) with a few made-up completions added, one of them hostile.

The browser is Debian's headless Chromium; when it is missing, tools/install_chromium.sh installs it
(apt-get, as root), and the test fails with the reason if that does not work.
"""
import json
import math
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pytest

from simple_grpo.run.completions_log import log_completions, read_completions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE_RUN = os.path.join(ROOT, "tests", "data", "example_run")
PHRASE = "the answer is 42 apples"
SCRIPT = "<script>alert(1)</script>"
CANARY = "<img src=x onerror=\"document.body.setAttribute('data-pwned','1')\">"  # runs if the page lets HTML in
QUOTE_TOKEN = "x' onmouseover='alert(2)"  # would close the title attribute if it were not escaped
PROMPT = "<|im_start|>user\nAda has 40 apples and finds 2 more. How many apples does she have?<|im_end|>\n"


def completion(text_tokens, reward, advantage, correctness, step_gap=0.0):
    n = len(text_tokens)
    logps = [-0.1 * (i % 4) for i in range(n)]
    sampler = [lp - step_gap for lp in logps]
    return {"prompt": PROMPT, "completion": "".join(text_tokens), "reward": reward,
            "rewards": {"correctness": correctness, "format": 1.0}, "advantage": advantage,
            "tokens": text_tokens, "logps": logps, "sampler_logps": sampler,
            "ratio": [math.exp(a - b) for a, b in zip(logps, sampler)]}


def make_run(run):
    """A run in `run`: the example run's metrics and completions (real: tests/data/example_run/README.md),
    and at step 50 four made-up completions, one of them hostile."""
    shutil.copytree(EXAMPLE_RUN, run, ignore=shutil.ignore_patterns("README.md"))
    log_completions(str(run / "completions.jsonl"), 50, [
        completion(["<think>", " 40", "+", "2", "=", "42", "</think>", "<answer>", "42", "</answer>"], 1.5, 0.7, 1.0),
        completion(["<think>", " 40", "-", "2", "</think>", "<answer>", "38", "</answer>"], 0.5, -0.7, 0.0, 0.3),
        completion(["<think>", " so", " the", " answer", " is", " 42", " apples", "</think>"], 1.0, 0.7, 1.0),
        completion(["<think>", SCRIPT, CANARY, QUOTE_TOKEN, "</think>"], 0.0, -0.7, 0.0)])
    return run


@pytest.fixture
def run_dir(tmp_path):
    return make_run(tmp_path / "viewer_example")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The small run's report.html, written once for the tests that only read it."""
    run = make_run(tmp_path_factory.mktemp("report") / "viewer_example")
    out = view_run(run)
    assert out.returncode == 0, out.stderr[-2000:]
    return run / "report.html"


def view_run(*args):
    return subprocess.run([sys.executable, "tools/view_run.py", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


class DomText(HTMLParser):
    """What a reader sees of a page (text outside <style> and <script>), and the elements it holds."""

    def __init__(self):
        super().__init__()
        self.text, self.tags, self.attributes, self.links, self._skip = [], [], [], [], 0

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attributes.extend(name for name, _ in attrs)
        self.links.extend(value for name, value in attrs if name in ("src", "href"))
        self._skip += tag in ("style", "script")

    def handle_endtag(self, tag):
        self._skip -= tag in ("style", "script") and self._skip > 0

    def handle_data(self, data):
        if not self._skip:
            self.text.append(data)


def parse(html_text):
    page = DomText()
    page.feed(html_text)
    return "".join(page.text), page


# ---------------------------------------------------------------------------- the page as written
def test_the_report_is_one_self_contained_page(report):
    page = report.read_text()
    assert "data:image/png;base64," in page  # the curves, embedded
    text, elements = parse(page)
    assert elements.links and all(link.startswith("data:") for link in elements.links)  # nothing from elsewhere
    assert "url(" not in page and "@import" not in page
    assert "script" not in elements.tags and "link" not in elements.tags
    assert "step 60" in text and "reward_mean" in text


def test_completion_text_is_escaped_in_the_file(report):
    page = report.read_text()
    assert SCRIPT not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    _, elements = parse(page)
    assert "onerror" not in elements.attributes and "onmouseover" not in elements.attributes


def test_token_hover_gives_logprob_ratio_and_sampler_gap(report):
    page = report.read_text()
    assert "logp -0.1000" in page and "sampler logp" in page and "gap +0.3000" in page and "ratio 1.3499" in page


def test_without_completions_the_page_says_which_flag_logs_them(run_dir):
    os.remove(run_dir / "completions.jsonl")
    out = view_run(run_dir)
    assert out.returncode == 0, out.stderr[-2000:]
    text, _ = parse((run_dir / "report.html").read_text())
    assert "No completions were logged" in text and "--log_completions_every N" in text


def test_the_run_doctors_warnings_are_listed_and_kept_out_of_the_curves(run_dir):
    message = "no group had reward variance in the last 10 batches <b>"
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 61, "warning": "no_signal", "message": message}) + "\n")
    out = view_run(run_dir)
    assert out.returncode == 0, out.stderr[-2000:]
    page = (run_dir / "report.html").read_text()
    text, _ = parse(page)
    assert "Run doctor" in text and "no_signal at step 61: " + message in text
    assert "10 batches &lt;b&gt;" in page  # the message is text, escaped
    assert "60 steps logged" in text  # the warning line is not a step


def test_a_missing_run_directory_is_named(tmp_path):
    out = view_run(tmp_path / "no_such_run")
    assert out.returncode != 0 and str(tmp_path / "no_such_run") in out.stderr and "not found" in out.stderr


def test_a_missing_metrics_file_is_named(tmp_path):
    out = view_run(tmp_path)
    assert out.returncode != 0 and str(tmp_path / "metrics.jsonl") in out.stderr


def test_log_completions_refuses_per_token_lists_of_another_length(tmp_path):
    row = completion(["a", "b"], 1.0, 0.5, 1.0)
    row["logps"] = [-0.1]
    with pytest.raises(ValueError, match="'logps' has 1 values for 2 tokens"):
        log_completions(tmp_path / "c.jsonl", 1, [row])


def test_log_completions_rows_read_back(tmp_path):
    path = tmp_path / "c.jsonl"
    log_completions(path, 3, [{"prompt": "p", "completion": "c", "reward": 1.0}])
    (row,) = read_completions(path)
    assert row["step"] == 3 and row["tokens"] == [] and row["logps"] is None and row["rewards"] == {}


# ---------------------------------------------------------------------------- the page in a browser
@pytest.fixture(scope="module")
def chromium():
    """The chromium command; installed by tools/install_chromium.sh when missing (a failure fails the test)."""
    if shutil.which("chromium") is None:
        out = subprocess.run(["bash", "tools/install_chromium.sh"], cwd=ROOT, capture_output=True, text=True,
                             timeout=900)
        if out.returncode != 0 or shutil.which("chromium") is None:
            pytest.fail(f"chromium is missing and tools/install_chromium.sh could not install it "
                        f"(exit {out.returncode}):\n{out.stdout[-1500:]}\n{out.stderr[-1500:]}")
    return shutil.which("chromium")


def headless(chromium, *args):
    return subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow  # installs Debian's chromium on first use (~20 s, 348 MB): kept out of CI's fast suite
def test_a_browser_shows_the_completions_as_text_and_runs_none_of_them(report, chromium, tmp_path):
    url = report.resolve().as_uri()
    out = headless(chromium, "--dump-dom", url)
    assert out.returncode == 0 and "</html>" in out.stdout, out.stderr[-2000:]
    text, dom = parse(out.stdout)
    assert PHRASE in text  # the tokens, one span each, read as one text
    assert SCRIPT in text and "&lt;script&gt;" in out.stdout  # shown as text ...
    assert "script" not in dom.tags  # ... and no script element came from it
    assert "data-pwned" not in dom.attributes and "onerror" not in dom.attributes
    assert "onmouseover" not in dom.attributes

    screenshot = os.path.join(ROOT, "docs", "report_screenshot.png") if os.environ.get("SAVE_SCREENSHOT") == "1" \
        else str(tmp_path / "report.png")
    out = headless(chromium, f"--screenshot={screenshot}", "--window-size=1280,1600", url)
    assert out.returncode == 0, out.stderr[-2000:]
    assert os.path.getsize(screenshot) > 20_000  # a blank 1280x1600 page is ~10 kB
