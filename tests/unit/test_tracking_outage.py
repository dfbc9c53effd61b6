"""Telling a tracking server that is down from one that refuses, the monitor's short requests,
the spool file's content, and where the end-of-run summary says the unsent metrics are."""

from __future__ import annotations

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import pytest
import requests
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException, RestException
from mlflow.protos.databricks_pb2 import ErrorCode

from relax_core.config import ConfigError, config_from_dict
from relax_core.tracking.console import format_summary
from relax_core.tracking.outage import RETRIES_ENV, TIMEOUT_ENV, is_outage, quick_requests
from relax_core.tracking.spool import Spooled


def _rest(code: str) -> RestException:
    return RestException({"error_code": code, "message": f"a {code} reply"})


def _wrapped(cause: BaseException, chained_as: str) -> MlflowException:
    """An MlflowException as MLflow's http_request raises it around a requests error."""
    err = MlflowException(f"API request failed with exception {cause}")
    setattr(err, chained_as, cause)
    return err


@pytest.mark.parametrize(
    "err",
    [
        _wrapped(requests.ConnectionError("Connection refused"), "__context__"),
        _wrapped(requests.Timeout("read timed out"), "__cause__"),
        _wrapped(requests.exceptions.RetryError("too many 503 error responses"), "__context__"),
        _rest(ErrorCode.Name(ErrorCode.INTERNAL_ERROR)),  # a 500 once the retries are used up
        _rest(ErrorCode.Name(ErrorCode.TEMPORARILY_UNAVAILABLE)),  # 503
    ],
)
def test_a_server_that_cannot_answer_is_an_outage(err):
    assert is_outage(err)


@pytest.mark.parametrize(
    "err",
    [
        _rest(ErrorCode.Name(ErrorCode.INVALID_PARAMETER_VALUE)),  # 400: a bad metric
        _rest(ErrorCode.Name(ErrorCode.RESOURCE_DOES_NOT_EXIST)),  # 404: no such run
        MlflowException("Invalid metric name"),  # raised by the client itself
        ValueError("not MLflow at all"),
    ],
)
def test_a_refusal_is_not_an_outage(err):
    assert not is_outage(err)


def test_quick_requests_set_mlflows_settings_inside_only(monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, "300")  # the user's own, for every other MLflow call
    monkeypatch.delenv(RETRIES_ENV, raising=False)
    with quick_requests(timeout_s=3, retries=0):
        assert os.environ[TIMEOUT_ENV] == "3" and os.environ[RETRIES_ENV] == "0"
        with quick_requests(timeout_s=4, retries=1):
            assert os.environ[TIMEOUT_ENV] == "4"
        assert os.environ[TIMEOUT_ENV] == "3"
    assert os.environ[TIMEOUT_ENV] == "300" and RETRIES_ENV not in os.environ


def test_a_spool_file_gives_back_exactly_what_was_logged():
    # Re-sent metrics must match the first send bit for bit (MLflow's SQL stores then keep one).
    metrics = [Metric("train/kl", 0.1 + 0.2, 1764000000123, 7), Metric("loss", 1e-300, 1, 0)]
    kept = Spooled("http://mlflow:5000", "abc", metrics, "FINISHED", 1764000000999)
    back = Spooled.from_bytes(kept.to_bytes())
    assert back == kept


def test_the_summary_says_where_unsent_metrics_are():
    files = ["s3://b/r/mlflow-spool/abc.1.json", "s3://b/r/mlflow-spool/abc.2.json"]
    text = format_summary({"mlflow_run_id": "abc", "mlflow_unsent": files})
    assert all(f in text for f in files) and "relax send-metrics" in text
    assert "unsent" not in format_summary({"mlflow_run_id": "abc", "mlflow_unsent": []})


@pytest.mark.parametrize(
    ("tracking", "message"),
    [
        ({"request_timeout_s": 0}, "tracking.request_timeout_s: must be > 0"),
        ({"request_retries": 11}, "tracking.request_retries: must be 0-10"),
    ],
)
def test_request_settings_are_checked(tracking, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"tracking": tracking})
