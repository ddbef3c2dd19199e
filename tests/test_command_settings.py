"""What ``demo`` and ``soak`` make of the ``STAGING_CONTRACTS_*`` variables and of
``--metrics-port`` before any rank process starts (review of issue 26, items 5 and 13).

A bad variable is one line and exit 2 at once; a variable applies where the command line
did not set the option (the command line first, then the variable, then the command's own
value); a variable the command must fix is named in a warning; a port out of range, or the
metrics extra missing, is a usage error."""

from __future__ import annotations

import sys
import time

import pytest

from staging_contracts import cli, config
from staging_contracts._cluster.metrics_relay import (
    METRICS_EXTRA_HINT,
    MetricsRelay,
    check_metrics_available,
)
from staging_contracts._cluster.preflight import check_environment, ignored_variables
from staging_contracts._cluster.soak_rank import SOAK_PREFILL_TIMEOUTS
from staging_contracts._cluster.soak_report import (
    SOAK_LIVENESS_TIMEOUT_S,
    SOAK_STALL_TIMEOUT_S,
    SoakConfig,
    config_from_args,
)
from staging_contracts._control.security import SECRET_ENV, SECRET_FILE_ENV


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No variable of the table, and no secret, from the caller's environment."""
    for setting in config.SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv(SECRET_ENV, raising=False)


def _soak_config(*words: str) -> SoakConfig:
    return config_from_args(cli._parser("soak").parse_args(["soak", *words]))


@pytest.mark.parametrize("command", ["demo", "soak"])
def test_a_bad_variable_is_one_line_and_exit_2_before_any_process(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STAGING_CONTRACTS_STALL_TIMEOUT_S", "abc")
    started = time.monotonic()
    assert cli.main([command]) == 2
    assert time.monotonic() - started < 10  # no rank process: they take longer to start
    err = capsys.readouterr().err
    assert err == (
        f"staging-contracts {command}: STAGING_CONTRACTS_STALL_TIMEOUT_S='abc': not a number "
        "of seconds\n"
    )


def test_a_liveness_interval_above_the_soaks_timeout_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The soak's liveness timeout is 3 s: an interval of 4 s would have every watched
    peer declared dead between two pings (half the rooms failed "peer dead", and yet PASS)."""
    monkeypatch.setenv("STAGING_CONTRACTS_LIVENESS_INTERVAL_S", "4")
    assert cli.main(["soak", "--duration", "10", "--faults", "none"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "STAGING_CONTRACTS_LIVENESS_INTERVAL_S=4" in err
    assert "3 s" in err


def test_the_interval_is_checked_against_the_command_line_timeout_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STAGING_CONTRACTS_LIVENESS_INTERVAL_S", "1")
    check_environment(liveness_timeout_s=3.0)
    with pytest.raises(ValueError, match="STAGING_CONTRACTS_LIVENESS_INTERVAL_S=1"):
        check_environment(liveness_timeout_s=1.0)
    with pytest.raises(ValueError, match="interval"):
        _soak_config("--liveness-timeout", "0.8")


def test_a_soak_option_comes_from_the_command_line_then_the_variable_then_the_soak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = _soak_config()
    assert plain.liveness_timeout_s == SOAK_LIVENESS_TIMEOUT_S
    assert plain.stall_timeout_s == SOAK_STALL_TIMEOUT_S
    assert plain.rank_settings().body.prefill_timeouts == SOAK_PREFILL_TIMEOUTS

    monkeypatch.setenv("STAGING_CONTRACTS_LIVENESS_TIMEOUT_S", "7")
    monkeypatch.setenv("STAGING_CONTRACTS_LIVENESS_INTERVAL_S", "0.25")
    monkeypatch.setenv("STAGING_CONTRACTS_STALL_TIMEOUT_S", "9")
    monkeypatch.setenv("STAGING_CONTRACTS_META_TIMEOUT_S", "11")
    monkeypatch.setenv("STAGING_CONTRACTS_PREFILL_DEADLINE_S", "12")
    env = _soak_config()
    settings = env.rank_settings()
    assert (settings.body.liveness_timeout_s, settings.body.liveness_interval_s) == (7.0, 0.25)
    assert (settings.body.stall_timeout_s, settings.body.meta_timeout_s) == (9.0, 11.0)
    assert settings.body.prefill_timeouts.deadline_s == 12.0
    assert settings.body.prefill_timeouts.answer_s == SOAK_PREFILL_TIMEOUTS.answer_s

    explicit = _soak_config("--liveness-timeout", "2")
    assert explicit.liveness_timeout_s == 2.0


def test_a_variable_the_command_fixes_is_named_in_a_warning() -> None:
    fixed = {config.RING_BYTES: "the command sizes the ring"}
    assert ignored_variables(fixed, environ={}) == []
    assert ignored_variables(fixed, environ={"STAGING_CONTRACTS_RING_BYTES": " "}) == []
    assert ignored_variables(fixed, environ={"STAGING_CONTRACTS_RING_BYTES": "4096"}) == [
        "warning: STAGING_CONTRACTS_RING_BYTES=4096 is ignored here: the command sizes the ring"
    ]


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
@pytest.mark.parametrize("command", ["demo", "soak"])
def test_a_metrics_port_out_of_range_is_a_usage_error(
    command: str, port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main([command, "--metrics-port", port])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"staging-contracts {command}: argument --metrics-port: ")
    assert "port number" in err
    assert err.count("\n") == 1


def test_without_prometheus_client_the_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'staging-contracts\[metrics\]'"):
        check_metrics_available()
    with pytest.raises(ImportError, match=r"pip install 'staging-contracts\[metrics\]'"):
        MetricsRelay().serve(0)
    assert cli.main(["soak", "--duration", "1", "--metrics-port", "0"]) == 2
    assert capsys.readouterr().err == f"staging-contracts soak: {METRICS_EXTRA_HINT}\n"
