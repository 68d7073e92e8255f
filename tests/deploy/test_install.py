"""The images' install steps, run for real: the package is built and installed exactly as the
Dockerfiles do it (their COPY lines, then deploy/docker/install.sh) into a fresh venv, and the
server is started through the image's entrypoint and answered by its health check.

The slow test of this directory (one to two minutes on 2 cores: a fresh venv, the dependencies
from the package index, building the package, loading the model).
"""

import importlib.metadata
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deploy_paths import DEPLOY, DOCKERFILES, REPO

DOCKER = DEPLOY / "docker"


def copy_like_the_dockerfile(root: Path) -> Path:
    """Apply the COPY lines of the Dockerfiles (identical in all three) with `root` as the image's /."""
    copies = {tuple(re.findall(r"^COPY (.+)$", p.read_text(), flags=re.M)) for p in DOCKERFILES}
    assert len(copies) == 1, "the three Dockerfiles must copy the same files (one install, three bases)"
    for line in copies.pop():
        *sources, dest = line.split()
        target = root / dest.lstrip("/")
        for source in sources:
            path = REPO / source
            into = target / path.name if dest.endswith("/") else target
            into.parent.mkdir(parents=True, exist_ok=True)
            if path.is_dir():
                shutil.copytree(path, into, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(path, into)
    return root / "opt" / "turboserve"


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{cmd} failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


def provide_base_image_torch(venv: Path) -> None:
    """Stand in for the base image's torch: link torch and what it needs from this interpreter's
    environment into the venv (as in the images, it is there before install.sh runs and is kept)."""
    site = Path(next(p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir()))
    target = next((venv / "lib").glob("python*/site-packages"))
    todo, seen = ["torch"], set()
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        if dist.metadata["Name"].lower() in seen:
            continue
        seen.add(dist.metadata["Name"].lower())
        for top in {Path(f).parts[0] for f in dist.files or []} - {"..", "bin"}:
            if (site / top).exists() and not (target / top).exists():
                (target / top).symlink_to(site / top)
        todo += [re.match(r"[A-Za-z0-9._-]+", r).group(0) for r in dist.requires or [] if "extra ==" not in r]


@pytest.fixture(scope="module")
def image_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("image")
    venv = root / "venv"
    run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    provide_base_image_torch(venv)
    opt = copy_like_the_dockerfile(root)
    python = venv / "bin" / "python"
    run(["bash", str(opt / "install.sh"), str(opt / "src")], env={**os.environ, "PYTHON": str(python)}, cwd=root,
        timeout=900)  # fmt: skip
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_installed_package_is_the_copied_source_without_triton(image_root):
    python = image_root / "venv" / "bin" / "python"
    where = run([str(python), "-c", "import server; print(server.__file__)"], cwd=image_root, env={"PATH": "/usr/bin:/bin"})
    assert "site-packages" in where.stdout and str(REPO) not in where.stdout
    # install.sh never installs Triton and the CPU torch does not bring it: the server below runs
    # without Triton, as on the Jetson base image.
    triton = run([str(python), "-c", "import importlib.util; print(importlib.util.find_spec('triton'))"],
                 cwd=image_root, env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    assert triton.stdout.strip() == "None"


def test_server_starts_from_the_install_and_passes_the_image_health_check(image_root):
    venv_bin = image_root / "venv" / "bin"
    opt = image_root / "opt" / "turboserve"
    port = free_port()
    models = image_root / "models"
    models.mkdir(exist_ok=True)
    env = {
        "PATH": f"{venv_bin}:/usr/bin:/bin", "HOME": str(image_root), "OMP_NUM_THREADS": "1",
        "PYTHON": str(venv_bin / "python"), "TURBOSERVE_MODELS_DIR": str(models),
        # What the images set, and what a compose file passes for flags its user left unset.
        "TURBOSERVE_HOST": "127.0.0.1", "TURBOSERVE_PORT": str(port), "TURBOSERVE_API_KEY": "",
        "TURBOSERVE_KV_CACHE_MEMORY": "64MiB", "TURBOSERVE_MAX_MODEL_LEN": "256",
    }  # fmt: skip
    log_path = image_root / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(["bash", str(opt / "entrypoint.sh")], cwd=image_root, env=env, stdout=log,
                                  stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline, healthy = time.monotonic() + 240, None
        while time.monotonic() < deadline and server.poll() is None:
            healthy = subprocess.run([str(venv_bin / "python"), str(opt / "healthcheck.py")], env=env,
                                     capture_output=True, timeout=30)  # fmt: skip
            if healthy.returncode == 0:
                break
            time.sleep(1)
        output = log_path.read_text()
        assert healthy is not None and healthy.returncode == 0, f"never healthy:\n{output[-4000:]}"
        assert "serving the embedded SmolLM2" in output
        assert "running on CPU with the reference kernels" in output
        # TURBOSERVE_API_KEY="" means no key (the entrypoint drops empty variables), so no header is needed.
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                           json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 2})  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_entrypoint_refuses_an_ambiguous_models_folder(image_root):
    models = image_root / "two-models"
    for name in ("a.gguf", "b.gguf"):
        (models / name).parent.mkdir(exist_ok=True)
        (models / name).write_bytes(b"")
    env = {"PATH": f"{image_root / 'venv' / 'bin'}:/usr/bin:/bin", "TURBOSERVE_MODELS_DIR": str(models)}
    done = subprocess.run(["bash", str(image_root / "opt" / "turboserve" / "entrypoint.sh")], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert "several models" in done.stderr and "TURBOSERVE_MODEL" in done.stderr
