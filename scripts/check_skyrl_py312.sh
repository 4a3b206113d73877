#!/usr/bin/env bash
# Checks creditlab's SkyRL integration on Python 3.12, where the README's test run (Python 3.11)
# cannot go: SkyRL 0.4.0 (its newest release, Python >= 3.12 only) and SkyRL's trainer path
# (skyrl.train.trainer, which needs Python >= 3.12 with pydantic 2, in 0.3.0 as in 0.4.0).
#
# In a Python 3.12 virtual environment it installs this checkout (editable) with the `skyrl` extra,
# then for each SkyRL version:
#   1. imports skyrl.train.trainer and SkyRL's initialize_ray (with creditlab loaded);
#   2. runs creditlab's SkyRL tests: tests/integrations/test_skyrl.py (registries, losses,
#      estimators, config, FORK environment) and tests/integrations/test_skyrl_ray.py (SkyRL's own
#      initialize_ray and registry sync, every creditlab function looked up and called in Ray workers);
#   3. when SKYRL_SRC names a checkout of SkyRL's repository (its wheel has no tests), runs SkyRL's own
#      registry and loss tests there with creditlab loaded first (a pytest plugin that imports
#      creditlab.integrations.skyrl): SKYRL_TEST_FILES, by default its registry tests
#      (tests/backends/skyrl_train/utils/test_ppo_utils.py) and the tests of its policy losses and
#      off-policy correction (tests/train/algorithms/test_losses.py, test_off_policy_correction.py);
#      SkyRL's tests/backends/skyrl_train/conftest.py starts a local Ray for the whole session.
#
# Usage:  scripts/check_skyrl_py312.sh        (from anywhere; exit status 0 when every check passed,
#                                             2 when there is no Python 3.12 interpreter)
#         scripts/check_skyrl_py312.sh --find-python   (prints the interpreter it would use; exit 2: none)
# Environment:
#   PYTHON312       the interpreter (default: python3.12 on PATH, else pyenv's newest 3.12.x)
#   VENV            the environment to build, or reuse when it exists
#                   (default: ${XDG_CACHE_HOME:-$HOME/.cache}/creditlab/skyrl-py312)
#   SKYRL_VERSIONS  the SkyRL versions to check, in order (default: "0.3.0 0.4.0"; the last stays installed)
#   SKYRL_SRC       a checkout of SkyRL's repository (optional; git clone https://github.com/NovaSky-AI/SkyRL)
#   SKYRL_TEST_FILES  SkyRL's test files to run there (default: the three above)
#   TORCH           the torch requirement installed first (default: torch)
#
# Cost: PyPI's torch for Python 3.12 on Linux is a CUDA build (no CPU build is on PyPI); with its
# nvidia-* wheels the environment takes about 6.4 GB, and the first run several minutes
# (docs/integrations.md has the measured figures). A later run reuses the environment.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/creditlab/skyrl-py312}"
SKYRL_VERSIONS="${SKYRL_VERSIONS:-0.3.0 0.4.0}"
SKYRL_TEST_FILES="${SKYRL_TEST_FILES:-tests/backends/skyrl_train/utils/test_ppo_utils.py tests/train/algorithms/test_losses.py tests/train/algorithms/test_off_policy_correction.py}"
TORCH="${TORCH:-torch}"

is_python312() { [ -n "$1" ] && "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; }

find_python312() {
    if [ -n "${PYTHON312:-}" ]; then echo "$PYTHON312"; return; fi
    local candidate
    for candidate in "$(command -v python3.12 || true)" \
            $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python 2>/dev/null | sort -rV); do
        if is_python312 "$candidate"; then echo "$candidate"; return; fi  # a pyenv shim may not run
    done
}

PY="$(find_python312)"
if ! is_python312 "$PY"; then
    echo "check_skyrl_py312: no Python 3.12 interpreter (set PYTHON312, or install one: pyenv install 3.12)" >&2
    exit 2
fi
if [ "${1:-}" = "--find-python" ]; then echo "$PY"; exit 0; fi
if [ $# -gt 0 ]; then echo "check_skyrl_py312: unknown argument $1 (only --find-python)" >&2; exit 2; fi

step() { printf '\n== %s (%s)\n' "$1" "$(date +%H:%M:%S)"; }

# run_pytest DIR ARGS...: pytest in DIR; prints its output and sets RESULT to its closing line
run_pytest() {
    local dir="$1" log
    shift
    log="$(mktemp)"
    if (cd "$dir" && "$VENV/bin/python" -m pytest -p no:cacheprovider "$@") 2>&1 | tee "$log"; then
        RESULT="$(grep -E '[0-9]+ (passed|failed)' "$log" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')"
    else
        RESULT="FAILED: $(grep -E '[0-9]+ (passed|failed)|error' "$log" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')"
        status=1
    fi
    rm -f "$log"
}
SECONDS=0
if [ ! -x "$VENV/bin/python" ]; then
    step "creating $VENV with $PY"
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
fi
step "installing $TORCH, then creditlab[skyrl] (editable: $ROOT), pytest, hypothesis"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$TORCH"
"$VENV/bin/python" -m pip install -q -e "$ROOT[skyrl]" pytest hypothesis
echo "installed in ${SECONDS} s; environment size: $(du -sh "$VENV" | cut -f1)"

declare -a SUMMARY=()
status=0
for version in $SKYRL_VERSIONS; do
    step "SkyRL $version"
    start=$SECONDS
    "$VENV/bin/python" -m pip install -q "skyrl==$version"
    "$VENV/bin/python" -m pip check || true  # informational: SkyRL's heavy extras are not installed
    if "$VENV/bin/python" -c '
import sys, importlib.metadata as md
import creditlab.integrations.skyrl as cs
import skyrl.train.trainer
from skyrl.train.utils.utils import initialize_ray
print("imports: python", sys.version.split()[0], "skyrl", md.version("skyrl"), "torch", md.version("torch"),
      "ray", md.version("ray"), "- creditlab", cs.check_version(), "and skyrl.train.trainer import")
'; then imports=ok; else imports=FAILED; status=1; fi
    run_pytest "$ROOT" tests/integrations/test_skyrl.py tests/integrations/test_skyrl_ray.py
    ours="$RESULT"
    theirs="not run (SKYRL_SRC unset)"
    if [ -n "${SKYRL_SRC:-}" ]; then
        plugin="$(mktemp -d)"
        printf '%s\n' '"""pytest plugin: creditlab loaded before the tests are collected."""' \
            'import creditlab.integrations.skyrl  # noqa: F401  (registers creditlab in SkyRL'"'"'s registries)' \
            > "$plugin/creditlab_loaded.py"
        # shellcheck disable=SC2086  # the file list splits on spaces
        PYTHONPATH="$plugin${PYTHONPATH:+:$PYTHONPATH}" run_pytest "$SKYRL_SRC" -q -p creditlab_loaded $SKYRL_TEST_FILES
        theirs="$RESULT"
        rm -rf "$plugin"
    fi
    SUMMARY+=("SkyRL $version: trainer imports $imports; creditlab's SkyRL tests: $ours; SkyRL's own tests with creditlab loaded: $theirs ($((SECONDS - start)) s)")
done

step "summary (total ${SECONDS} s)"
printf '%s\n' "${SUMMARY[@]}"
exit $status
