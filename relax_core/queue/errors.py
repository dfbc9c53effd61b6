"""How storage failures are told apart: a lost create race, a transient fault, or a setup error.

Object-store clients report the same condition in different shapes (s3fs turns some S3 error codes
into Python exceptions and wraps the rest in OSError; botocore raises its own connection errors),
so the classification walks the exception's cause chain and looks at S3 error codes and HTTP
status, not at one exception type.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

_TRANSIENT_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "Throttling",
    "ThrottlingException",
}
_DENIED_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
}


class StorageError(RuntimeError):
    """A storage failure a person has to act on; the message names the bucket/prefix and a fix."""


class StorageUnavailable(StorageError):
    """Storage could not be reached, or kept failing transiently after every retry."""

    exit_code = 75
    """What a role process exits with on it (EX_TEMPFAIL), so its supervisor stops the run
    instead of restarting a process that would wait for the same storage."""


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _s3_error(err: BaseException) -> tuple[str, int]:
    """(S3 error code, HTTP status) from a botocore ClientError in `err`'s chain, else ("", 0)."""
    for e in _chain(err):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and "Error" in response:
            code = str(response["Error"].get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return code, int(status or 0)
    return "", 0


def is_precondition_failed(err: BaseException) -> bool:
    """Whether `err` is a refused conditional write (S3 `PreconditionFailed`, HTTP 412)."""
    if isinstance(err, FileExistsError):
        return True
    code, status = _s3_error(err)
    if code == "PreconditionFailed" or status == 412:
        return True
    text = " ".join(str(a) for e in _chain(err) for a in (e, *getattr(e, "args", ())))
    return "PreconditionFailed" in text or "Precondition Failed" in text


def is_access_denied(err: BaseException) -> bool:
    """Wrong or missing credentials, or a policy that forbids the operation."""
    code, status = _s3_error(err)
    if code in _DENIED_CODES or status == 403:
        return True
    for e in _chain(err):
        if isinstance(e, PermissionError) or type(e).__name__ in {
            "NoCredentialsError",
            "PartialCredentialsError",
        }:
            return True
    return False


def is_missing_bucket(err: BaseException) -> bool:
    code, _ = _s3_error(err)
    if code == "NoSuchBucket":
        return True
    return any("bucket does not exist" in str(e).lower() for e in _chain(err))


def is_transient(err: BaseException) -> bool:
    """A fault worth retrying: connection trouble, timeouts, throttling, server errors (5xx)."""
    if is_precondition_failed(err) or is_access_denied(err):
        return False
    code, status = _s3_error(err)
    if code in _TRANSIENT_CODES or status >= 500:
        return True
    for e in _chain(err):
        if isinstance(e, ConnectionError | TimeoutError | asyncio.TimeoutError):
            return True
        # botocore's connection errors and aiohttp's client errors are not OSError subclasses.
        mod = type(e).__module__
        name = type(e).__name__
        if mod.startswith("botocore") and ("Connection" in name or "Timeout" in name):
            return True
        if mod.startswith("aiohttp") and ("Connect" in name or "Payload" in name):
            return True
    return False
