"""What tree a GPU visit runs, recorded by the tree (simple_grpo/run/provenance.py): the commit, whether the tree
had changes, and a hash of its tracked files, read by git where the repository is and carried with the tree.

    python tools/provenance.py write    # here, before the visit: writes .gpu-carry/provenance.json, which travels
    python tools/provenance.py check --out $OUT/provenance.json    # there (the visit scripts run it first)

check hashes the same files again on the machine that runs the tree (whose own .git may be absent or stale) and
prints one line: the carried commit, its changes, and whether the tree here is the one described. It stops, naming
the command above, where nothing was carried.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from simple_grpo.run.provenance import CARRIED, ROOT, check, describe, write  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["write", "check"], help="write: here, before a visit; check: on the GPU")
    ap.add_argument("--out", help="check: also write the record (JSON) here")
    ap.add_argument("--root", default=ROOT, help="the tree (default: this repository)")
    args = ap.parse_args()
    if args.action == "write":
        print(f"{CARRIED}: {describe(write(args.root))}")
        return
    record = check(args.root)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    print(describe(record))


if __name__ == "__main__":
    main()
