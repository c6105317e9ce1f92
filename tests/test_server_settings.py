"""`python -m vramledger.worker serve`'s HTTP settings: its flags and the VRAMLEDGER_* variables, read in one place."""
import pytest

from vramledger.worker.cli import build_parser
from vramledger.worker.http.settings import ServerSettings


def settings(*flags: str, **environ: str) -> ServerSettings:
    return ServerSettings.from_args(build_parser().parse_args(["serve", *flags]), environ)


def test_defaults_without_flags_or_environment():
    s = settings()
    assert (s.api_key, s.max_waiting, s.metrics, s.protect_metrics, s.served_model_name, s.drain_timeout) == (
        None, 256, True, False, None, 30.0)


def test_flags_reach_the_settings():
    s = settings("--api-key", "k", "--max-waiting", "3", "--served-model-name", "coder", "--drain-timeout", "2.5")
    assert (s.api_key, s.max_waiting, s.served_model_name, s.drain_timeout) == ("k", 3, "coder", 2.5)


def test_intake_flags_reach_the_settings_and_bad_values_are_refused():
    s = settings("--keep-alive-timeout", "2", "--header-timeout", "3", "--body-timeout", "4.5",
                 "--max-receiving-bodies", "6")
    assert (s.keep_alive_timeout, s.header_timeout, s.body_timeout, s.max_receiving_bodies) == (2, 3, 4.5, 6)
    for flags in (("--max-receiving-bodies", "0"), ("--header-timeout", "0"), ("--body-timeout", "-1")):
        with pytest.raises(ValueError, match=flags[0]):
            settings(*flags)


def test_the_environment_sets_the_key_and_metrics_and_the_key_flag_wins():
    assert settings(VRAMLEDGER_API_KEY="from-env").api_key == "from-env"
    assert settings("--api-key", "from-flag", VRAMLEDGER_API_KEY="from-env").api_key == "from-flag"
    assert settings(VRAMLEDGER_API_KEY="").api_key is None
    assert settings(VRAMLEDGER_METRICS_AUTH="1").protect_metrics
    assert not settings(VRAMLEDGER_METRICS_AUTH="yes").protect_metrics
    for off in ("off", "OFF", "0", "false"):
        assert not settings(VRAMLEDGER_METRICS=off).metrics
    assert settings(VRAMLEDGER_METRICS="on").metrics


def test_max_waiting_below_one_is_refused():
    with pytest.raises(ValueError, match="--max-waiting must be >= 1"):
        settings("--max-waiting", "0")
