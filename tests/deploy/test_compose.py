"""Every compose variant validates with the Compose v2 binary and has what operators rely on."""

import json
import subprocess

import pytest

from deploy_paths import COMPOSE_VARIANTS, DEPLOY


def resolved(compose_binary, files: list[str]) -> dict:
    args = [str(compose_binary)] + [a for f in files for a in ("-f", str(DEPLOY / f))]
    quiet = subprocess.run(args + ["config", "--quiet"], capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, f"compose config --quiet {files}:\n{quiet.stderr}"
    full = subprocess.run(args + ["config", "--format", "json"], capture_output=True, text=True, timeout=120)
    assert full.returncode == 0, full.stderr
    return json.loads(full.stdout)


@pytest.mark.parametrize("variant", COMPOSE_VARIANTS)
def test_variant_validates_with_the_stack_operators_expect(compose_binary, variant):
    config = resolved(compose_binary, COMPOSE_VARIANTS[variant])
    services = config["services"]
    assert set(services) == {"turboserve", "prometheus", "grafana"}
    for name, service in services.items():
        assert service.get("restart") == "unless-stopped", f"{name} has no restart policy"
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    assert {"models", "prometheus-data", "grafana-data"} <= set(config["volumes"])
    dockerfile = services["turboserve"]["build"]["dockerfile"]
    expected = "cuda" if variant == "cpu" else variant
    assert dockerfile == f"deploy/docker/Dockerfile.{expected}"
    mounts = {v["target"] for v in services["grafana"]["volumes"]}
    assert {"/etc/grafana/provisioning", "/var/lib/grafana/dashboards/turboserve.json"} <= mounts


def test_accelerator_access_per_variant(compose_binary):
    cuda = resolved(compose_binary, COMPOSE_VARIANTS["cuda"])["services"]["turboserve"]
    devices = cuda["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    jetson = resolved(compose_binary, COMPOSE_VARIANTS["jetson"])["services"]["turboserve"]
    assert jetson["runtime"] == "nvidia"
    rocm = resolved(compose_binary, COMPOSE_VARIANTS["rocm"])["services"]["turboserve"]
    assert {d["source"] for d in rocm["devices"]} == {"/dev/kfd", "/dev/dri"}
    assert "video" in rocm["group_add"]
