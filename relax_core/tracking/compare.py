"""Comparing MLflow runs: a comparison of two or more runs is one MLflow UI URL.

`resolve_runs` turns what a person types (a run id, or a run name such as the relax run id
`cpu-default-20261122-081500`) into MLflow runs; `compare_url` builds the UI's compare page for
them; `previous_run` finds the training run to compare a new one with.

The URL is the one the MLflow UI itself builds (`Routes.getCompareRunPageRoute` in the bundle
under mlflow/server/js/build): `<ui>/#/compare-runs?runs=<JSON list>&experiments=<JSON list>`.
The page URL-decodes the whole query before reading the two JSON lists, so they are sent
percent-encoded; ids are restricted to MLflow's run id characters so no `&`, `=` or `%`
can split or re-decode them.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse

from mlflow.entities import Run, ViewType
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (
    INVALID_PARAMETER_VALUE,
    RESOURCE_DOES_NOT_EXIST,
    ErrorCode,
)
from mlflow.tracking import MlflowClient

DEFAULT_UI_URL = "http://127.0.0.1:5000"
"""What `mlflow ui` / `mlflow server` serve by default."""
EVALUATION_KIND = "evaluation"
"""Value of the `relax.kind` tag on evaluation runs, which are not training runs to compare."""

# MLflow's own run id pattern (mlflow.utils.validation._RUN_ID_REGEX); experiment ids fit it too.
_ID_RE = re.compile(r"^[a-zA-Z0-9][\w\-]{0,255}$")
_PAGE_SIZE = 1000
_NOT_FOUND_CODES = {
    ErrorCode.Name(RESOURCE_DOES_NOT_EXIST),
    ErrorCode.Name(INVALID_PARAMETER_VALUE),
}


def ui_base_url() -> str:
    """The MLflow UI's base URL: env MLFLOW_UI_URL when set, else `mlflow ui`'s default."""
    return os.environ.get("MLFLOW_UI_URL", "").strip() or DEFAULT_UI_URL


def compare_url(ui_base: str, experiment_ids: list[str], run_ids: list[str]) -> str:
    """The MLflow UI page comparing `run_ids` (at least 2, distinct) of `experiment_ids`."""
    parsed = urllib.parse.urlsplit(ui_base)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(
            f"ui_base must be an http(s) URL such as {DEFAULT_UI_URL}, got {ui_base!r}"
        )
    if parsed.query or parsed.fragment:
        raise ValueError(f"ui_base must not carry a query or #fragment, got {ui_base!r}")
    if len(run_ids) < 2:
        raise ValueError(f"a comparison needs at least 2 run ids, got {len(run_ids)}")
    if len(set(run_ids)) != len(run_ids):
        repeated = sorted({r for r in run_ids if run_ids.count(r) > 1})
        raise ValueError(f"run ids must be distinct; repeated: {', '.join(repeated)}")
    if not experiment_ids:
        raise ValueError("experiment_ids must name at least one experiment")
    _check_ids("run id", run_ids)
    _check_ids("experiment id", experiment_ids)
    experiments = list(dict.fromkeys(experiment_ids))  # distinct, first-seen order
    base = ui_base.rstrip("/")
    return (
        f"{base}/#/compare-runs?runs={_json_param(run_ids)}&experiments={_json_param(experiments)}"
    )


def resolve_runs(tracking_uri: str, refs: list[str]) -> list[Run]:
    """The runs named by `refs`, in order; each ref is an MLflow run id or a run name.

    A run id wins over a run name. A name must match exactly one active run across all active
    experiments; an unknown ref or a name shared by several runs raises ValueError.
    """
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment_ids: list[str] | None = None
    runs = []
    for ref in refs:
        if not isinstance(ref, str) or not ref.strip():
            raise ValueError(f"a run reference must be a non-empty run id or run name, got {ref!r}")
        run = _get_run_by_id(client, ref)
        if run is None:
            if experiment_ids is None:
                experiment_ids = _all_experiment_ids(client)
            run = _get_run_by_name(client, experiment_ids, ref, tracking_uri)
        runs.append(run)
    return runs


def previous_run(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """Id of the newest other FINISHED training run of `experiment_id` started before `run_id`.

    Evaluation runs (tag `relax.kind` = "evaluation") are skipped; None when there is no such run.
    """
    client = MlflowClient(tracking_uri=tracking_uri)
    started = client.get_run(run_id).info.start_time
    query = "attributes.status = 'FINISHED'"
    if started is not None:
        query += f" and attributes.start_time < {int(started)}"
    page_token = None
    while True:
        page = client.search_runs(
            [experiment_id],
            filter_string=query,
            run_view_type=ViewType.ACTIVE_ONLY,
            max_results=_PAGE_SIZE,
            order_by=["attributes.start_time DESC"],
            page_token=page_token,
        )
        for run in page:
            if run.info.run_id != run_id and run.data.tags.get("relax.kind") != EVALUATION_KIND:
                return run.info.run_id
        page_token = page.token
        if not page_token:
            return None


def _check_ids(what: str, ids: list[str]) -> None:
    for value in ids:
        if not isinstance(value, str) or not _ID_RE.match(value):
            raise ValueError(
                f"{what} {value!r} is not an MLflow id (letters, digits, '_' and '-', "
                "starting with a letter or digit)"
            )


def _json_param(values: list[str]) -> str:
    # JSON.stringify's form (no spaces), then percent-encoded: '[', '"' and ']' are not URL-safe.
    return urllib.parse.quote(json.dumps(values, separators=(",", ":")), safe="")


def _get_run_by_id(client: MlflowClient, ref: str) -> Run | None:
    if not _ID_RE.match(ref):
        return None
    try:
        return client.get_run(ref)
    except MlflowException as err:
        if err.error_code in _NOT_FOUND_CODES:
            return None
        raise


def _all_experiment_ids(client: MlflowClient) -> list[str]:
    ids: list[str] = []
    page_token = None
    while True:
        page = client.search_experiments(
            view_type=ViewType.ACTIVE_ONLY, max_results=_PAGE_SIZE, page_token=page_token
        )
        ids += [experiment.experiment_id for experiment in page]
        page_token = page.token
        if not page_token:
            return ids


def _get_run_by_name(
    client: MlflowClient, experiment_ids: list[str], name: str, tracking_uri: str
) -> Run:
    if "'" not in name:
        query = f"attributes.run_name = '{name}'"
    elif '"' not in name:
        query = f'attributes.run_name = "{name}"'
    else:
        raise ValueError(f"run name {name!r} holds both quote characters; pass its run id instead")
    matches: list[Run] = []
    page_token = None
    while experiment_ids:
        page = client.search_runs(
            experiment_ids,
            filter_string=query,
            run_view_type=ViewType.ACTIVE_ONLY,
            max_results=_PAGE_SIZE,
            order_by=["attributes.start_time DESC"],
            page_token=page_token,
        )
        matches += list(page)
        page_token = page.token
        if not page_token:
            break
    if not matches:
        raise ValueError(f"no MLflow run has id or name {name!r} in {tracking_uri}")
    if len(matches) > 1:
        ids = ", ".join(run.info.run_id for run in matches)
        raise ValueError(
            f"run name {name!r} matches {len(matches)} runs in {tracking_uri} (newest first: "
            f"{ids}); pass one of these run ids instead"
        )
    return matches[0]
