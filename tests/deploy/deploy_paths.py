"""Paths and tool lookup shared by the deployment tests (a unique name: conftest modules collide)."""

import shutil
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile.*"))
COMPOSE_VARIANTS = {
    "cpu": ["compose.yaml"],
    "cuda": ["compose.yaml", "compose.cuda.yaml"],
    "jetson": ["compose.yaml", "compose.jetson.yaml"],
    "rocm": ["compose.yaml", "compose.rocm.yaml"],
}


def require_tool(name: str, how: str) -> str:
    """The tool's path; a missing tool fails the test (never a silent skip) and says how to install it."""
    path = shutil.which(name) or shutil.which(name, path=sysconfig.get_path("scripts"))
    if path is None:
        pytest.fail(f"`{name}` is not installed: {how}")
    return path
