"""The elastic API's requests and operations: the errors it answers with, what a scaling
operation records, and the checks every request body passes (elastic.py acts on them)."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from relax_core.rollout.server_client import ServerClient
from relax_core.rollout.sglang_engine import SGLangClient, SGLangError
from relax_core.rollout.vllm_engine import VLLMError, require_rl_api


class ApiError(Exception):
    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


class EngineHost(Protocol):
    """What the pool needs from the launcher that owns the processes."""

    def start_engine(self, worker: int) -> None: ...

    def engine_process(self, name: str) -> tuple[int, int | None] | None:
        """(pid, exit code or None while it runs) of the engine's newest process, or None."""
        ...


@dataclass
class Operation:
    id: str
    kind: str
    request: dict[str, Any]
    engines: list[str]
    target: int
    status: str = "running"
    """running -> succeeded; running -> cancelling -> cancelled (scale out); -> cancelled."""
    message: str = ""
    created: float = field(default_factory=time.time)
    finished: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "url": f"/{self.kind}/{self.id}"}


def fields_of(body: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object with {' or '.join(allowed)}")
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise ApiError(400, f"unknown field(s) {unknown}; allowed: {list(allowed)}")
    return body


_URL = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+(:[0-9]{1,5})?")


def urls_of(value: Any) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(u, str) for u in value):
        raise ApiError(400, f'"urls" must be a non-empty list of http(s) URLs, got {value!r}')
    urls = [u.rstrip("/") for u in value]
    bad = [u for u in urls if not _URL.fullmatch(u)]
    if bad:
        raise ApiError(400, f"not an http(s)://host:port URL of an SGLang server: {bad}")
    if len(set(urls)) != len(urls):
        raise ApiError(400, f'"urls" names a server twice: {urls}')
    return urls


def probe_server(url: str, engine: str = "sglang") -> None:
    """ApiError 400 unless `url` answers as a server of the run's rollout.engine: healthy, and
    for vLLM with the RL API the trainer's weight updates go through."""
    what = "a vLLM" if engine == "vllm" else "an SGLang"
    # SGLang's /health generates a token (a second or more, 503 while paused); its /ready is
    # the cheap check. vLLM's /health is cheap.
    path = "/health" if engine == "vllm" else "/ready"
    try:
        SGLangClient(url, timeout_s=5.0).get(path)
    except SGLangError as err:
        raise ApiError(400, f"{url} does not answer as {what} server: {err}") from err
    if engine == "vllm":
        try:
            require_rl_api(ServerClient(url, timeout_s=30.0))
        except VLLMError as err:
            raise ApiError(400, str(err)) from err


def count_of(value: Any, what: str, low: int, high: int) -> int:
    if type(value) is not int:  # bool is an int subclass: refused too
        raise ApiError(400, f"{what} must be an integer, got {json.dumps(value)}")
    if not low <= value <= high:
        raise ApiError(400, f"{what} must be {low}..{high}, got {value}")
    return value
