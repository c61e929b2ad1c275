"""Configuration file, flags and the CLI's argument handling."""

from __future__ import annotations

import os

import pytest
from tramprof.commands.cli import EXIT_CONFIG, _run_config, build_parser, main
from tramprof.config import Config, ConfigError, from_mapping, load_file
from tramprof.pipeline.profiler import sampler_config


def test_defaults_need_no_file():
    config = Config().validated()
    assert config.listen == "127.0.0.1:9947"
    assert config.frequency == 99 and config.frequency % 2 == 1
    assert config.pids == ()


def test_file_and_flags(tmp_path):
    path = tmp_path / "tramprof.toml"
    path.write_text('frequency = 49\ninterval = 5\npids = [1, 2]\nlisten = "0.0.0.0:9000"\n')
    config = load_file(str(path))
    assert (config.frequency, config.interval, config.pids) == (49, 5.0, (1, 2))
    args = build_parser().parse_args(["run", "--config", str(path), "--frequency", "199",
                                      "--pid", "7", "--pid", "8", "9"])
    merged = _run_config(args)
    assert merged.frequency == 199 and merged.pids == (7, 8, 9)
    assert merged.listen == "0.0.0.0:9000" and merged.interval == 5.0


@pytest.mark.parametrize(("data", "key"), [
    ({"frequncy": 99}, "frequncy"),
    ({"frequency": "99"}, "frequency"),
    ({"frequency": 0}, "frequency"),
    ({"frequency": True}, "frequency"),
    ({"interval": 0.0}, "interval"),
    ({"pids": [1, "x"]}, "pids"),
    ({"pids": [-1]}, "pids"),
    ({"event": "instructions"}, "event"),
    ({"listen": "nowhere"}, "listen"),
    ({"max_keys": 1}, "max_keys"),
    ({"scan_window_bytes": 1000}, "scan_window_bytes"),      # not a multiple of 512
    ({"scan_window_bytes": 1 << 19}, "scan_window_bytes"),   # beyond the tail-call chain
])
def test_bad_settings_name_the_key(data, key):
    with pytest.raises(ConfigError, match=f"^{key}:"):
        from_mapping(data)


def test_bad_files(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("frequency = [")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_file(str(bad))
    with pytest.raises(ConfigError, match="cannot read"):
        load_file(str(tmp_path / "missing.toml"))
    assert main(["run", "--config", str(bad)]) == EXIT_CONFIG == 78
    assert "configuration error" in capsys.readouterr().err


def test_metrics_command_prints_the_table(capsys):
    assert main(["metrics"]) == 0
    assert "`tramprof_samples_total`" in capsys.readouterr().out


@pytest.mark.skipif(not os.path.exists("/sys/kernel/btf/vmlinux"), reason="kernel has no BTF")
def test_print_bpf_shows_source_and_offsets(capsys):
    assert main(["run", "--print-bpf"]) == 0
    out = capsys.readouterr().out
    assert "-DTP_OFF_TASK_START_BOOTTIME=" in out
    assert "int on_sample(struct bpf_perf_event_data *ctx)" in out


def test_environment_between_file_and_flags(tmp_path):
    from tramprof.config import from_environment, load

    path = tmp_path / "t.toml"
    path.write_text("frequency = 49\nmax_series = 500\n")
    env = {"TRAMPROF_FREQUENCY": "199", "TRAMPROF_PIDS": "3, 4", "TRAMPROF_GROUP_BY":
           "comm container_id", "PATH": "/bin", "TRAMPROF_TRAMPOLINES": "1"}
    config = load(str(path), environ=env, overrides={"pids": (9,)})
    assert config.frequency == 199 and config.max_series == 500
    assert config.pids == (9,) and config.group_by == ("comm", "container_id")
    with pytest.raises(ConfigError, match=r"^frequency: environment variable"):
        from_environment({"TRAMPROF_FREQUENCY": "fast"})
    with pytest.raises(ConfigError, match=r"^frequncy: unknown setting"):
        from_environment({"TRAMPROF_FREQUNCY": "1"})
    with pytest.raises(ConfigError, match=r"^group_by:"):
        from_environment({"TRAMPROF_GROUP_BY": "hostname"})


def test_config_check_and_show(tmp_path, capsys):
    good = tmp_path / "good.toml"
    good.write_text('listen = "0.0.0.0:9947"\ngroup_by = ["comm", "pod_uid"]\n')
    assert main(["config", "check", str(good)]) == 0
    assert capsys.readouterr().out.strip() == f"{good}: ok"
    bad = tmp_path / "bad.toml"
    bad.write_text('tls_cert_file = "/etc/cert.pem"\n')
    assert main(["config", "check", str(bad)]) == EXIT_CONFIG
    assert "tls_cert_file: set both" in capsys.readouterr().err
    assert main(["config", "show"]) == 0
    assert "TRAMPROF_MAX_SERIES" in capsys.readouterr().out


def test_scan_window_reaches_the_sampler():
    args = build_parser().parse_args(["run", "--scan-window", "16384"])
    config = _run_config(args)
    assert config.scan_window_bytes == 16384
    assert sampler_config(config).scan_bytes == 16384
    assert sampler_config(Config()).scan_bytes == 65536
    largest = from_mapping({"scan_window_bytes": 1 << 18})
    assert sampler_config(largest).scan_bytes == 1 << 18  # the sampler accepts it too


def test_global_flags_before_or_after_the_command(tmp_path):
    """--log-level/--log-format are accepted on either side of the command
    name (and of nested ones); given before, a later default cannot erase them."""
    parser = build_parser()
    for argv in (["--log-level", "debug", "--log-format", "json", "run"],
                 ["run", "--log-level", "debug", "--log-format", "json"],
                 ["--log-level", "debug", "run", "--log-format", "json"]):
        args = parser.parse_args(argv)
        assert (args.command, args.log_level, args.log_format) == ("run", "debug", "json")
        assert _run_config(args).log_level == "debug"
    args = parser.parse_args(["config", "check", "x.toml", "--log-level", "error"])
    assert (args.config_command, args.log_level, args.log_format) == ("check", "error", None)
    args = parser.parse_args(["record", "--log-level", "info", "--", "sleep", "1"])
    assert (args.log_level, args.argv) == ("info", ["sleep", "1"])
    args = parser.parse_args(["record", "--", "python3", "app.py", "--log-level", "x"])
    assert args.log_level is None and args.argv == ["python3", "app.py", "--log-level", "x"]
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["run", "--log-format", "xml"])
    assert exc.value.code == 2


def test_record_command_and_targets_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["record", "--pid", "1", "--", "true"])
    assert exc.value.code == 2
    assert "either a COMMAND or --pid/--all" in capsys.readouterr().err
