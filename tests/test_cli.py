"""`turboserve` / `python -m server`: flags, TURBOSERVE_<FLAG> environment defaults, sizes, and
subcommands whose module is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from server import cli


@pytest.mark.parametrize("text, expected", [
    ("2GiB", 2 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5GB", 1_500_000_000), ("4096", 4096),
    ("64 kib", 65536), ("3KB", 3000),
])
def test_sizes_parse_with_binary_and_decimal_units(text, expected):
    assert cli.parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "2XB", "-1GiB", "", "1e9"])
def test_bad_sizes_are_refused_with_an_example(text):
    with pytest.raises(Exception, match="e.g. 2GiB"):
        cli.parse_size(text)


def test_serve_flags_default_from_the_environment_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("TURBOSERVE_PORT", "9123")
    monkeypatch.setenv("TURBOSERVE_KV_CACHE_MEMORY", "1GiB")
    monkeypatch.setenv("TURBOSERVE_ENFORCE_EAGER", "true")
    monkeypatch.setenv("TURBOSERVE_KV_CACHE_DTYPE", "turbo3")
    monkeypatch.setenv("TURBOSERVE_API_KEY", "k")
    args = cli.build_parser().parse_args(["serve", "--port", "7000"])
    assert args.port == 7000 and args.kv_cache_memory == 2**30 and args.enforce_eager is True
    assert args.api_key == "k" and args.kv_cache_dtype == "turbo3"
    config = cli.engine_config_from_args(args)
    assert config.kv_cache_memory == 2**30 and config.kv_cache_dtype == "turbo3" and config.enforce_eager
    assert config.kv_key_offset == "partial" and config.kv_key_turned_pairs is None  # 8, or all of a smaller head
    turned = cli.engine_config_from_args(cli.build_parser().parse_args(["serve", "--kv-key-offset", "turned"]))
    assert turned.kv_key_offset == "turned"
    partial = cli.engine_config_from_args(cli.build_parser().parse_args(
        ["serve", "--kv-key-offset", "partial", "--kv-key-turned-pairs", "16"]))
    assert partial.kv_key_offset == "partial" and partial.kv_key_turned_pairs == 16
    assert config.kv_balance is True, "turbo KV channel balance on by default"
    assert cli.engine_config_from_args(cli.build_parser().parse_args(["serve", "--no-kv-balance"])).kv_balance is False
    monkeypatch.setenv("TURBOSERVE_NO_KV_BALANCE", "1")
    assert cli.engine_config_from_args(cli.build_parser().parse_args(["serve"])).kv_balance is False


def test_an_unknown_key_offset_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["serve", "--kv-key-offset", "rope"])
    assert exit_.value.code == 2 and "choose from 'fixed', 'partial', 'turned', 'none'" in capsys.readouterr().err


def test_defaults_match_the_documented_ones(monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith("TURBOSERVE_")]:
        monkeypatch.delenv(name)
    args = cli.build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.model, args.max_body_bytes, args.allowed_origins) == (
        "127.0.0.1", 8000, None, None, 4 * 2**20, ())


def test_allowed_origins_parse_from_the_flag_and_the_environment(monkeypatch):
    parse = cli.build_parser().parse_args
    args = parse(["serve", "--allowed-origins", "https://a.example, http://localhost:3000/"])
    assert args.allowed_origins == ("https://a.example", "http://localhost:3000")
    monkeypatch.setenv("TURBOSERVE_ALLOWED_ORIGINS", "*")
    assert cli.build_parser().parse_args(["serve"]).allowed_origins == ("*",)


@pytest.mark.parametrize("text", ["a.example", "https://a.example/path", "*, https://a.example", "ftp://a"])
def test_bad_origins_are_refused_with_an_example(text, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["serve", "--allowed-origins", text])
    assert exit_.value.code == 2 and "--allowed-origins" in capsys.readouterr().err


def test_a_bad_environment_value_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("TURBOSERVE_DTYPE", "float8")
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser()
    assert exit_.value.code == 2
    assert "TURBOSERVE_DTYPE='float8'" in capsys.readouterr().err


def test_a_subcommand_whose_module_is_missing_says_so_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(cli, "EXTERNAL_COMMANDS", (("perplexity", "server.tools.no_such_module", "top"),))
    assert cli.main(["perplexity", "--file", "x"]) == 2
    assert "'perplexity' is not available yet" in capsys.readouterr().err


def test_python_dash_m_server_lists_every_subcommand():
    result = subprocess.run([sys.executable, "-m", "server", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for command in ("serve", "perplexity", "quantize", "bench"):
        assert command in result.stdout


def test_serve_with_a_missing_model_fails_with_a_clear_message():
    result = subprocess.run([sys.executable, "-m", "server", "serve", "--model", "/nonexistent/model.gguf"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "/nonexistent/model.gguf does not exist" in result.stderr
