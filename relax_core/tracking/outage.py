"""Telling an MLflow tracking server that is down from one that refuses a request, and keeping
the monitor's own requests short while it is down.

A server that cannot answer (connection refused or reset, a timeout, a 5xx or 429 after the
client's retries) is an outage: the caller keeps its metrics and sends them later. A 4xx reply
(a bad metric name, a run that does not exist) is an answer, and is raised as it is.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import requests
from mlflow.exceptions import MlflowException, RestException

# The settings MLflow's REST client reads from the environment at every request
# (mlflow.utils.rest_utils.http_request, MLflow 3.17). MLflow has no per-client setting for them.
TIMEOUT_ENV = "MLFLOW_HTTP_REQUEST_TIMEOUT"
RETRIES_ENV = "MLFLOW_HTTP_REQUEST_MAX_RETRIES"
BACKOFF_ENV = "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"
_env_lock = threading.RLock()


def is_outage(err: BaseException) -> bool:
    """Whether `err`, raised by an MlflowClient call, means the server could not answer now."""
    if isinstance(err, RestException):
        status = err.get_http_status_code()
        return status >= 500 or status == 429
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        # requests' ConnectionError, Timeout and RetryError (retries used up on a 5xx or 429);
        # MLflow wraps them in an MlflowException, chained as its cause or context.
        if isinstance(cause, requests.RequestException | ConnectionError | TimeoutError):
            return not _is_client_error(cause)
        cause = cause.__cause__ or cause.__context__
    return False


def _is_client_error(err: BaseException) -> bool:
    response = getattr(err, "response", None)
    status = getattr(response, "status_code", None)
    return status is not None and 400 <= status < 500 and status != 429


@contextlib.contextmanager
def quick_requests(timeout_s: int, retries: int) -> Iterator[None]:
    """MLflow HTTP requests made inside wait at most `timeout_s` per try and retry `retries`
    times without backoff, instead of MLflow's defaults (120 s, 7 retries with backoff: minutes
    per call while a server is down).

    The variables are set around the monitor's own calls only and restored after, so MLflow
    calls elsewhere in the process (a model registration's upload) keep MLflow's settings. They
    are process-wide while set: another thread's MLflow request at that moment sees them too.
    """
    wanted = {TIMEOUT_ENV: str(timeout_s), RETRIES_ENV: str(retries), BACKOFF_ENV: "0"}
    with _env_lock:
        saved = {name: os.environ.get(name) for name in wanted}
        os.environ.update(wanted)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def brief(err: BaseException) -> str:
    """The first line of an MLflow error, without the request URL's long tail."""
    text = err.message if isinstance(err, MlflowException) else str(err)
    return text.strip().splitlines()[0][:300] if text.strip() else type(err).__name__
