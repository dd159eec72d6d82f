#!/usr/bin/env bash
# Install megascale-data into a virtual environment. One script for every install of the project:
# `make install` (so CI's fresh install, .ci/run -> make test) and the container image (Dockerfile)
# both run it, so what CI tests is what the image installs.
#
#   tools/install.sh [--editable] VENV [EXTRAS] [TORCH_SPEC]
#
#   tools/install.sh --editable .venv 'test,torch,plots,docs' torch==2.13.0   # a developer's / CI's
#   tools/install.sh /opt/msd                                                   # the image: no torch
#
# EXTRAS are pyproject's optional dependencies (comma-separated, none by default). TORCH_SPEC is
# installed first, pinned: any other torch spec may pull a multi-GB CUDA build. PYTHON picks the
# interpreter (default python3).
set -euo pipefail
editable=()
if [ "${1:-}" = "--editable" ]; then editable=(-e); shift; fi
venv=${1:?usage: tools/install.sh [--editable] VENV [EXTRAS] [TORCH_SPEC]}
extras=${2:-}
torch=${3:-}
src=$(cd "$(dirname "$0")/.." && pwd)
"${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade pip
if [ -n "$torch" ]; then "${pip[@]}" "$torch"; fi
"${pip[@]}" "${editable[@]}" "$src${extras:+[$extras]}"
