#!/usr/bin/env bash
# Run the README's test command (every unit test and every notebook) on a torch, a build of it
# and a Python of your choice:
#
#   tools/test_on_torch.sh TORCH TORCHVISION [pytest arguments...]
#   tools/test_on_torch.sh 2.12.0 0.27.0
#   tools/test_on_torch.sh 2.15.0 0.29.2 notebooks/15_pipeline_parallelism.ipynb
#   tools/test_on_torch.sh newest newest                 # the newest pair pip gives
#   tools/test_on_torch.sh 2.13.0+cpu none               # a CPU-only build, torchvision absent
#   MGTUTOR_PYTHON=python3.10 tools/test_on_torch.sh 2.11.0 0.26.0
#
# It makes a fresh virtual environment with MGTUTOR_PYTHON (default python3), installs that
# torch and torchvision (a matching pair: torch 2.N.P goes with torchvision 0.(N+15).P), then
# requirements.txt, which keeps them, and runs `python -m pytest` with the arguments given (none:
# the whole suite).
# - TORCHVISION "none" leaves torchvision out, as a learner who installed torch alone has it
#   (what needs it skips and says how to install it). A torch with a local version such as
#   "2.13.0+cpu" is a CPU-only build: it must have neither CUDA nor NCCL, or the run stops. pip
#   looks for it where pip is configured to (this machine keeps one on disk), then on PyPI's
#   neighbour for such builds, PyTorch's CPU index.
# - "newest" for both asks pip for the newest pair it gives (set PIP_CONSTRAINT=/dev/null to lift
#   a machine-wide cap).
#
# MGTUTOR_EXTRA_PACKAGES names packages to add (e.g. a peer to benchmark against).
#
# The environment goes in a temporary folder, removed at the end; set MGTUTOR_TORCH_VENV=PATH
# to keep it there (an existing one is reused as it is, nothing reinstalled).
# MGTUTOR_PREPARE_ONLY=1 (with MGTUTOR_TORCH_VENV) makes and checks the environment and runs no
# test: .ci/run prepares the next stage's while one stage's tests run.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 TORCH TORCHVISION [pytest arguments...]   (e.g. $0 2.11.0 0.26.0," >&2
    echo "       $0 newest newest, $0 2.13.0+cpu none)" >&2
    exit 2
fi
torch_version=$1 vision_version=$2
shift 2
cd "$(dirname "$0")/.."
python=${MGTUTOR_PYTHON:-python3}
if ! command -v "$python" >/dev/null; then
    echo "$0: no Python '$python' (set MGTUTOR_PYTHON to an interpreter's path)" >&2
    exit 2
fi

venv=${MGTUTOR_TORCH_VENV:-}
if [ -n "${MGTUTOR_PREPARE_ONLY:-}" ] && [ -z "$venv" ]; then
    echo "$0: MGTUTOR_PREPARE_ONLY needs MGTUTOR_TORCH_VENV=PATH (else the environment is removed at the end)" >&2
    exit 2
fi
if [ -z "$venv" ]; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    venv="$work/venv"
fi

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
    pip=("$venv/bin/python" -m pip install --quiet)
    "${pip[@]}" --upgrade pip
    requirements=requirements.txt
    if [ "$vision_version" = none ]; then
        requirements="$venv/requirements-without-torchvision.txt"
        grep -v '^torchvision' requirements.txt >"$requirements"
    fi
    if [ "$torch_version" = newest ]; then
        "${pip[@]}" torch $([ "$vision_version" = none ] || echo torchvision)
        # The constraint names the distribution's version, which pip compares: PyPI's 2.15.0 reports
        # torch.__version__ '2.15.0+cu132', which no distribution on PyPI is.
        installed=$("$venv/bin/python" -c "from importlib.metadata import version; print(version('torch'))")
        "${pip[@]}" -r "$requirements" -c <(echo "torch==$installed")
    else
        torch_pin="torch==$torch_version"
        if ! "${pip[@]}" "$torch_pin" 2>/dev/null; then
            case "$torch_version" in
                *+cpu) "${pip[@]}" "$torch_pin" --index-url https://download.pytorch.org/whl/cpu ;;
                *) "${pip[@]}" "$torch_pin" ;;  # again, to show pip's error
            esac
        fi
        [ "$vision_version" = none ] || "${pip[@]}" "$torch_pin" "torchvision==$vision_version"
        # The constraint keeps pip from replacing this torch with another build of a version that
        # also satisfies requirements.txt (torchvision from PyPI would bring PyPI's build).
        "${pip[@]}" -r "$requirements" -c <(echo "$torch_pin")
    fi
    if [ -n "${MGTUTOR_EXTRA_PACKAGES:-}" ]; then  # e.g. a peer to benchmark against
        installed=$("$venv/bin/python" -c "from importlib.metadata import version; print(version('torch'))")
        # shellcheck disable=SC2086
        "${pip[@]}" $MGTUTOR_EXTRA_PACKAGES -c <(echo "torch==$installed")
    fi
fi

installed=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
case "$torch_version" in
    newest) ;;
    *+*) [ "$installed" = "$torch_version" ] || mismatch=1 ;;
    *) [ "${installed%%+*}" = "$torch_version" ] || mismatch=1 ;;
esac
if [ -n "${mismatch:-}" ]; then
    echo "$venv has torch $installed, not $torch_version: remove it or name another" >&2
    exit 2
fi
case "$torch_version" in
    *+cpu)
        "$venv/bin/python" - <<'PY' || exit 2
import torch, torch.distributed as dist
if torch.version.cuda is not None or dist.is_nccl_available():
    raise SystemExit(f"torch {torch.__version__} has CUDA {torch.version.cuda} / NCCL "
                     f"{dist.is_nccl_available()}: not the CPU-only build this run is for")
PY
        ;;
esac
if [ "$vision_version" = none ] && "$venv/bin/python" -c "import torchvision" 2>/dev/null; then
    echo "$venv has torchvision, but this run is for torch without it" >&2
    exit 2
fi
described=$("$venv/bin/python" -c "
import platform, torch, torch.distributed as d
print(f'torch {torch.__version__} (CUDA {torch.version.cuda}, NCCL {d.is_nccl_available()}),',
      f'Python {platform.python_version()}')")
if [ -n "${MGTUTOR_PREPARE_ONLY:-}" ]; then
    echo "test_on_torch: $described, ready in $venv"
    exit 0
fi
echo "test_on_torch: $described, python -m pytest $*"
"$venv/bin/python" -m pytest "$@"
