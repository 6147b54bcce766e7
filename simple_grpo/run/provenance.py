"""What tree a run ran, recorded by the tree: its commit, whether it had changes, and a hash of its files. git is
asked where the repository is, and the answer travels with the tree in .gpu-carry/provenance.json; a GPU machine's
copy of the tree may carry no .git, or a stale one (`git rev-parse` there once read 42729a4 for a tree that was
0094fcc: docs/gpu_notes.md, visit 1), so there the carried answer is read and the same files are hashed again.
The hash covers the tracked files (`git ls-files`) as they are on disk, edits included. tools/provenance.py is its
command line. Standard library only.
"""
import hashlib
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
CARRY = ".gpu-carry"  # what a visit carries beside the tree (bundles, this record): untracked, not ignored, it travels
CARRIED = os.path.join(CARRY, "provenance.json")


def git(root, *args):
    """git's output in root, or an error that says what is wrong."""
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    except OSError as e:
        raise SystemExit(f"git could not run ({e}): write the provenance where the repository and git are")
    if out.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} in {root} failed: {out.stderr.strip()} (is it a git checkout?)")
    return out.stdout


def tree_hash(root, files):
    """sha256 of the files (paths relative to root) as they are on disk: each one's path and content, in path
    order; a file that is missing counts as missing, so deleting one changes the hash too."""
    tree = hashlib.sha256()
    for path in sorted(files):
        full = os.path.join(root, path)
        if os.path.islink(full):
            content = b"link:" + os.readlink(full).encode()
        elif os.path.isfile(full):
            with open(full, "rb") as f:
                content = b"file:" + hashlib.sha256(f.read()).digest()
        else:
            content = b"missing"
        tree.update(path.encode() + b"\0" + content + b"\0")
    return tree.hexdigest()


def provenance(root=ROOT):
    """Where the repository is: {"commit", "dirty", "changes" (git status --porcelain's lines but those of .gpu-carry/,
    the visit's own luggage), "tree_sha256", "files" (the tracked files hashed)}."""
    commit = git(root, "rev-parse", "HEAD").strip()
    changes = [line for line in git(root, "status", "--porcelain", "--untracked-files=all").splitlines()
               if not line[3:].startswith(CARRY + "/")]
    files = git(root, "ls-files", "-z").split("\0")[:-1]
    return {"commit": commit, "dirty": bool(changes), "changes": changes, "tree_sha256": tree_hash(root, files),
            "files": files}


def write(root=ROOT):
    """The provenance of the tree at root, written to root/.gpu-carry/provenance.json to travel with it; returns it."""
    record = provenance(root)
    path = os.path.join(root, CARRIED)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return record


def check(root=ROOT):
    """On the machine that runs the tree: the carried provenance, less its file list, with the same files hashed
    again here ("tree_sha256_here") and whether the two hashes agree ("tree_matches")."""
    path = os.path.join(root, CARRIED)
    if not os.path.isfile(path):
        raise SystemExit(f"{path} is missing: before the visit, run `python tools/provenance.py write` where the "
                         f"repository is, so that the tree carries what it is")
    with open(path) as f:
        record = json.load(f)
    here = tree_hash(root, record.pop("files"))
    return {**record, "tree_sha256_here": here, "tree_matches": here == record["tree_sha256"]}


def what_ran(root=ROOT):
    """For a run's report: on a visit, the carried record checked here; where nothing was carried, git's own
    account (this is the repository), less the file list; {"commit": None} where there is neither."""
    if os.path.isfile(os.path.join(root, CARRIED)):
        return check(root)
    try:
        record = provenance(root)
    except SystemExit:  # no git here, or not a checkout
        return {"commit": None}
    del record["files"]
    return record


def describe(record):
    """One line: commit, clean or not, and the tree hash (with the check's verdict where there is one)."""
    state = f"{len(record['changes'])} change(s): {', '.join(record['changes'][:5])}" if record["dirty"] else "clean"
    line = f"commit {record['commit'][:12]} ({state}), tree sha256 {record['tree_sha256'][:16]}"
    if "tree_matches" in record:
        line += (", the same here" if record["tree_matches"] else
                 f", but {record['tree_sha256_here'][:16]} here: the tree that runs is NOT the one described")
    return line
