"""Containers are configured by environment: every `turboserve serve` flag has its TURBOSERVE_ variable."""

import argparse

from server.cli import build_parser, env_name


def serve_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def test_every_serve_flag_names_its_environment_variable():
    flags = [a for a in serve_parser()._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert len(flags) >= 15, [a.option_strings for a in flags]
    for action in flags:
        flag = max(action.option_strings, key=len)
        assert f"[env {env_name(flag)}]" in (action.help or ""), f"{flag} cannot be set from the environment"


def test_serve_flags_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("TURBOSERVE_HOST", "0.0.0.0")
    monkeypatch.setenv("TURBOSERVE_KV_CACHE_DTYPE", "turbo3")
    monkeypatch.setenv("TURBOSERVE_KERNEL_TIMING_SAMPLE_RATE", "0.5")
    monkeypatch.setenv("TURBOSERVE_ENFORCE_EAGER", "1")
    assert build_parser().parse_args(["serve"]).async_scheduling is True
    monkeypatch.setenv("TURBOSERVE_NO_ASYNC_SCHEDULING", "1")
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.kv_cache_dtype, args.kernel_timing_sample_rate, args.enforce_eager) == (
        "0.0.0.0", "turbo3", 0.5, True
    )  # fmt: skip
    assert args.async_scheduling is False
