#!/usr/bin/env bash
# Container entry point: pick the model, say which kernels this image can run, start the server.
# Every `turboserve serve` flag can be set as TURBOSERVE_<FLAG> (e.g. TURBOSERVE_KV_CACHE_DTYPE);
# extra arguments are passed to `turboserve serve` as flags.
#
# Model: TURBOSERVE_MODEL (a path, or a name relative to /models) wins. Otherwise a single
# *.gguf file or Hugging Face directory (with config.json) found in /models is served; with
# nothing there, the embedded SmolLM2; with several candidates, we stop and ask.
set -euo pipefail
# Compose passes variables its user left unset as empty strings: empty means "use the default".
for var in $(compgen -e); do
    if [[ $var == TURBOSERVE_* && -z ${!var} ]]; then unset "$var"; fi
done
models_dir=${TURBOSERVE_MODELS_DIR:-/models}
python=${PYTHON:-python3}

if [[ -n ${TURBOSERVE_MODEL:-} ]]; then
    [[ $TURBOSERVE_MODEL == /* || -e $TURBOSERVE_MODEL ]] || TURBOSERVE_MODEL="$models_dir/$TURBOSERVE_MODEL"
    if [[ ! -e $TURBOSERVE_MODEL ]]; then
        echo "entrypoint: TURBOSERVE_MODEL=$TURBOSERVE_MODEL does not exist; mount the model under $models_dir" >&2
        exit 2
    fi
else
    candidates=()
    if [[ -d $models_dir ]]; then
        shopt -s nullglob
        for path in "$models_dir"/*.gguf "$models_dir"/*/config.json; do
            [[ $path == */config.json ]] && path=${path%/config.json}
            candidates+=("$path")
        done
    fi
    case ${#candidates[@]} in
        0) echo "entrypoint: no model in $models_dir; serving the embedded SmolLM2-135M-Instruct" ;;
        1) TURBOSERVE_MODEL=${candidates[0]} ;;
        *)
            echo "entrypoint: several models in $models_dir (${candidates[*]}); choose one with TURBOSERVE_MODEL" >&2
            exit 2
            ;;
    esac
fi
[[ -n ${TURBOSERVE_MODEL:-} ]] && export TURBOSERVE_MODEL && echo "entrypoint: serving $TURBOSERVE_MODEL"

# Triton is optional (e.g. missing on Jetson): without it every op runs its torch reference body.
"$python" - <<'PY'
import importlib.util

import torch

accel = "CUDA" if torch.cuda.is_available() and torch.version.hip is None else "ROCm" if torch.cuda.is_available() else None
if accel is None:
    print("entrypoint: no GPU visible to torch; running on CPU with the reference kernels")
elif importlib.util.find_spec("triton") is None:
    print(f"entrypoint: {accel} GPU found but Triton is not installed; running the reference torch kernels (slower)")
else:
    print(f"entrypoint: {accel} GPU {torch.cuda.get_device_name()} with Triton; fast kernels enabled")
PY

exec turboserve serve "$@"
