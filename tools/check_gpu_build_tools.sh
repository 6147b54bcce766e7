#!/usr/bin/env bash
# Can Triton build its C launchers here? On a GPU, vLLM's runner, torch.compile and triton_loss/ compile a
# small C file at their first call, with a C compiler ($CC, else gcc, else clang: Triton's order) against
# Python.h of the interpreter that runs them (sysconfig's include path).
#   bash tools/check_gpu_build_tools.sh [PYTHON]   # exit 0: yes; 1: no, with a message naming what is missing
# tools/install.sh runs it before installing the GPU requirements, with the Python .venv/ is made from.
set -euo pipefail
python="${1:-python3}"
if [ -n "${CC:-}" ]; then
    cc="$CC"
    found=$(command -v "$cc" || true)
    if [ -z "$found" ]; then
        echo "check_gpu_build_tools.sh: CC=$CC is not a command here; Triton compiles its launchers with \$CC." >&2
        echo "Set CC to a C compiler that is installed, or unset it to use gcc (Debian/Ubuntu: sudo apt-get install build-essential)." >&2
        exit 1
    fi
else
    found=$(command -v gcc || command -v clang || true)
    if [ -z "$found" ]; then
        echo "check_gpu_build_tools.sh: no C compiler (gcc or clang) on PATH, nor \$CC set. Triton (vLLM's GPU runner," >&2
        echo "torch.compile, triton_loss/) compiles a small launcher with one at its first call on a GPU. Install one:" >&2
        echo "  Debian/Ubuntu: sudo apt-get install build-essential python3-dev   (or set CC to a C compiler)" >&2
        exit 1
    fi
fi
# Triton reads posix_prefix where Debian's Python says posix_local (triton/runtime/build.py)
paths=$("$python" -c 'import sys, sysconfig; s = sysconfig.get_default_scheme()
print(sysconfig.get_paths(scheme="posix_prefix" if s == "posix_local" else s)["include"], "%d.%d" % sys.version_info[:2])') \
    || { echo "check_gpu_build_tools.sh: $python did not run: pass the Python that runs the trainers" >&2; exit 1; }
read -r include version <<< "$paths"
if [ ! -f "$include/Python.h" ]; then
    echo "check_gpu_build_tools.sh: Python.h is not in $include, the headers of $python (Python $version)," >&2
    echo "and Triton compiles its launchers against them. Install them:" >&2
    echo "  Debian/Ubuntu: sudo apt-get install python$version-dev   (python3-dev where python3 is $version)" >&2
    exit 1
fi
if ! echo '#include <Python.h>' | "$found" -x c -fsyntax-only -I"$include" - ; then
    echo "check_gpu_build_tools.sh: $found cannot compile a file that includes $include/Python.h (its message" >&2
    echo "is above). Debian/Ubuntu: sudo apt-get install build-essential python$version-dev" >&2
    exit 1
fi
echo "C compiler $found and Python $version's headers ($include): Triton can build its launchers"
