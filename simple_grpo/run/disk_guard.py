"""A full disk, told apart from other write errors (torch.save's has no errno) and named in plain words."""
import errno
import os
import shutil


def mount_point(path):
    """The file system `path` lives on: its mount point."""
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def tree_bytes(path):
    """Bytes in the files under path (0 if it is gone)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def is_disk_full(error, path, needed=1 << 20):
    """Whether `error`, raised writing under path, came from a full disk (or quota): ENOSPC or EDQUOT in its chain,
    or less room left than the write needed."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return shutil.disk_usage(path).free < max(needed, 1 << 20)


def describe(path):
    """'/mnt/runs (40 MB, 0.1 MB free)': the disk path is on."""
    usage = shutil.disk_usage(path)
    return f"{mount_point(path)} ({usage.total / 1e6:.0f} MB, {usage.free / 1e6:.1f} MB free)"


def full_disk_exit(path, what):
    """The SystemExit for a write that the disk holding path had no room for."""
    return SystemExit(f"no space left on the disk holding {path}: {describe(path)}. {what}")


def append_lines(path, lines):
    """Append lines to a log of the run; a full disk stops the run with a message that says so."""
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(lines)
    except OSError as e:
        if not is_disk_full(e, os.path.dirname(path) or "."):
            raise
        raise full_disk_exit(path, "The run stopped; its last checkpoint is whole: free some space, then run the "
                                   "same command with --resume") from None
