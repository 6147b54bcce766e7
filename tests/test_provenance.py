"""What ran on a GPU is recorded by the tree (simple_grpo/run/provenance.py, tools/provenance.py): git is asked
where the repository is and the answer travels with the tree; on the GPU machine the carried commit is reported
whatever .git says there, and the files are hashed again, so a tree that is not the one described shows. A real
git repository in a temporary folder."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from simple_grpo.run import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A git repository with one commit of two files."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "train.py").write_text("print('step')\n")
    (repo / "README.md").write_text("a tree\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "first")
    return repo


def test_a_clean_checkout_is_described_by_its_commit_and_files(repo):
    record = provenance.provenance(repo)
    assert record["commit"] == git(repo, "rev-parse", "HEAD")
    assert (record["dirty"], record["changes"], sorted(record["files"])) == (False, [], ["README.md", "train.py"])
    assert record["tree_sha256"] == provenance.tree_hash(repo, ["README.md", "train.py"])


def test_an_edit_makes_the_tree_dirty_and_changes_its_hash_and_so_does_a_new_file(repo):
    clean = provenance.provenance(repo)
    (repo / "train.py").write_text("print('another step')\n")
    edited = provenance.provenance(repo)
    assert edited["commit"] == clean["commit"]  # the commit alone does not say what ran
    assert edited["dirty"] and edited["changes"] == [" M train.py"]
    assert edited["tree_sha256"] != clean["tree_sha256"]
    (repo / "train.py").write_text("print('step')\n")
    (repo / "extra.py").write_text("")  # untracked: a change git status shows, outside the tracked files' hash
    untracked = provenance.provenance(repo)
    assert untracked["changes"] == ["?? extra.py"] and untracked["tree_sha256"] == clean["tree_sha256"]


def test_the_record_written_is_not_itself_a_change(repo):
    provenance.write(repo)
    assert os.path.isfile(repo / provenance.CARRIED)
    assert not provenance.provenance(repo)["dirty"]  # .gpu-carry/ is the visit's luggage, not the tree


def test_a_copy_without_git_reports_the_carried_commit_and_the_same_hash(repo, tmp_path):
    written = provenance.write(repo)
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))  # what the GPU machine gets
    assert not (copy / ".git").exists()
    record = provenance.check(copy)
    assert record["commit"] == written["commit"] and record["dirty"] is False
    assert record["tree_sha256_here"] == record["tree_sha256"] == written["tree_sha256"] and record["tree_matches"]


def test_a_copy_with_a_stale_git_still_reports_the_carried_commit(repo, tmp_path):
    """Visit 1's case: git on the GPU machine read another commit than the tree that ran."""
    old = git(repo, "rev-parse", "HEAD")
    (repo / "train.py").write_text("print('new step')\n")
    git(repo, "commit", "-q", "-am", "second")
    written = provenance.write(repo)
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy)
    git(copy, "update-ref", "HEAD", old)  # its .git says the first commit; its files are the second's
    assert git(copy, "rev-parse", "HEAD") == old != written["commit"]
    record = provenance.what_ran(copy)
    assert record["commit"] == written["commit"] and record["tree_matches"]


def test_a_copy_whose_files_differ_from_the_carried_record_says_so(repo, tmp_path):
    provenance.write(repo)
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    (copy / "train.py").write_text("print('edited on the GPU machine')\n")
    record = provenance.check(copy)
    assert not record["tree_matches"] and record["tree_sha256_here"] != record["tree_sha256"]
    assert "NOT the one described" in provenance.describe(record)
    os.remove(copy / "train.py")  # a file that did not travel
    assert not provenance.check(copy)["tree_matches"]


def test_check_without_a_carried_record_stops_and_says_what_to_run(tmp_path):
    with pytest.raises(SystemExit, match="python tools/provenance.py write"):
        provenance.check(tmp_path)
    assert provenance.what_ran(tmp_path) == {"commit": None}  # no git, nothing carried: nothing to claim


def test_the_visit_scripts_read_the_tree_and_set_no_commit_by_hand():
    for script in ("tools/gpu_visit_real.sh", "tools/gpu_visit_scale.sh", "bench/gpu_targets.sh"):
        text = open(os.path.join(ROOT, script)).read()
        assert "tools/provenance.py check" in text and "COMMIT" not in text, script


def test_the_command_line_writes_here_and_checks_there(repo, tmp_path):
    """tools/provenance.py as the visit scripts run it: write in the repository, check in a copy without .git."""
    tool = [sys.executable, os.path.join(ROOT, "tools", "provenance.py")]
    wrote = subprocess.run(tool + ["write", "--root", str(repo)], capture_output=True, text=True)
    assert wrote.returncode == 0, wrote.stderr
    commit = git(repo, "rev-parse", "HEAD")
    assert f"commit {commit[:12]} (clean)" in wrote.stdout
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    checked = subprocess.run(tool + ["check", "--root", str(copy), "--out", str(tmp_path / "p.json")],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert f"commit {commit[:12]} (clean)" in checked.stdout and "the same here" in checked.stdout
    assert json.load(open(tmp_path / "p.json"))["commit"] == commit
    shutil.rmtree(copy / ".gpu-carry")  # nothing carried: the visit stops before anything runs
    missing = subprocess.run(tool + ["check", "--root", str(copy)], capture_output=True, text=True)
    assert missing.returncode != 0 and "python tools/provenance.py write" in missing.stderr
