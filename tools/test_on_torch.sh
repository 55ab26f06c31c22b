#!/usr/bin/env bash
# Run the README's test command (every unit test and every notebook) on a torch of your choice:
#
#   tools/test_on_torch.sh TORCH TORCHVISION [pytest arguments...]
#   tools/test_on_torch.sh 2.12.0 0.27.0
#   tools/test_on_torch.sh 2.15.0 0.29.2 notebooks/15_pipeline_parallelism.ipynb
#
# It makes a fresh virtual environment, installs that torch and torchvision (a matching pair:
# torch 2.N.P goes with torchvision 0.(N+15).P), then requirements.txt, which keeps them, and
# runs `python -m pytest` with the arguments given (none: the whole suite). .ci/run's second
# stage is this script with the oldest torch the notebooks support.
#
# The environment goes in a temporary folder, removed at the end; set MGTUTOR_TORCH_VENV=PATH
# to keep it there (an existing one is reused as it is, nothing reinstalled).
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 TORCH TORCHVISION [pytest arguments...]   (e.g. $0 2.11.0 0.26.0)" >&2
    exit 2
fi
torch_version=$1 vision_version=$2
shift 2
cd "$(dirname "$0")/.."

venv=${MGTUTOR_TORCH_VENV:-}
if [ -z "$venv" ]; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    venv="$work/venv"
fi
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet "torch==$torch_version" "torchvision==$vision_version"
    "$venv/bin/python" -m pip install --quiet -r requirements.txt
fi
installed=$("$venv/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
if [ "$installed" != "$torch_version" ]; then
    echo "$venv has torch $installed, not $torch_version: remove it or name another" >&2
    exit 2
fi
echo "test_on_torch: torch $installed, python -m pytest $*"
"$venv/bin/python" -m pytest "$@"
