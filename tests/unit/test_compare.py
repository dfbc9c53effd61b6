"""Run comparison URLs, run lookup by id or name, and `relax compare`, on a real sqlite store."""

import json
import os
import urllib.parse
from dataclasses import dataclass

# mlflow decides whether to start its telemetry client when it is imported, so this must come first.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import pytest
from mlflow.tracking import MlflowClient

from relax_core.entrypoints import cli
from relax_core.tracking.compare import compare_url, previous_run, resolve_runs, ui_base_url


@dataclass
class Store:
    uri: str
    exp_a: str
    exp_b: str
    ids: dict[str, str]
    """Run name (unique names only) -> run id."""
    shared_name_ids: list[str]
    """Ids of the two runs both named "shared", oldest first."""


def _run(
    client: MlflowClient,
    experiment_id: str,
    name: str,
    start: int,
    status: str = "FINISHED",
    tags: dict[str, str] | None = None,
    accuracy: float | None = None,
) -> str:
    run = client.create_run(experiment_id, start_time=start, run_name=name, tags=tags or {})
    if accuracy is not None:
        client.log_metric(run.info.run_id, "eval/accuracy", accuracy / 2, step=0)
        client.log_metric(run.info.run_id, "eval/accuracy", accuracy, step=1)
    client.set_terminated(run.info.run_id, status=status, end_time=start + 1)
    return run.info.run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """One sqlite store per module: creating one runs MLflow's schema migrations (seconds).

    Experiment A, by start time: an old training run, a FAILED one, an evaluation run, the
    "current" run, then a later training run. Experiment B holds two runs sharing a name.
    """
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp_a = client.create_experiment("relax-a", artifact_location=(root / "art-a").as_uri())
    exp_b = client.create_experiment("relax-b", artifact_location=(root / "art-b").as_uri())
    ids = {
        "cpu-default-20261122-081500": _run(
            client, exp_a, "cpu-default-20261122-081500", 1000, accuracy=0.5
        ),
        "failed": _run(client, exp_a, "failed", 2000, status="FAILED"),
        "eval": _run(client, exp_a, "eval", 3000, tags={"relax.kind": "evaluation"}),
        "current": _run(
            client, exp_a, "current", 4000, tags={"relax.kind": "training"}, accuracy=0.75
        ),
        "later": _run(client, exp_a, "later", 5000),
        "in-b": _run(client, exp_b, "in-b", 1500),
    }
    shared = [_run(client, exp_b, "shared", 100), _run(client, exp_b, "shared", 200)]
    return Store(uri=uri, exp_a=exp_a, exp_b=exp_b, ids=ids, shared_name_ids=shared)


def test_compare_url_is_the_ui_route_with_encoded_json_lists() -> None:
    url = compare_url("http://127.0.0.1:5000", ["0"], ["a1b2", "c3d4"])

    # JSON.stringify(["a1b2","c3d4"]) with '[' -> %5B, '"' -> %22, ',' -> %2C, ']' -> %5D.
    assert url == (
        "http://127.0.0.1:5000/#/compare-runs"
        "?runs=%5B%22a1b2%22%2C%22c3d4%22%5D&experiments=%5B%220%22%5D"
    )


def test_compare_url_decodes_to_the_lists_the_page_parses() -> None:
    url = compare_url("https://mlflow.example.org/team/", ["3", "7", "3"], ["r1", "r2", "r3"])

    base, route = url.split("#", 1)
    assert base == "https://mlflow.example.org/team/"
    path, query = route.split("?", 1)
    assert path == "/compare-runs"
    fields = urllib.parse.parse_qs(query, strict_parsing=True)
    assert json.loads(fields["runs"][0]) == ["r1", "r2", "r3"]
    assert json.loads(fields["experiments"][0]) == ["3", "7"]  # repeats dropped, order kept


@pytest.mark.parametrize(
    ("ui_base", "experiments", "runs", "message"),
    [
        ("http://h:5000", ["0"], ["r1"], "at least 2 run ids"),
        ("http://h:5000", ["0"], [], "at least 2 run ids"),
        ("http://h:5000", ["0"], ["r1", ""], "run id ''"),
        ("http://h:5000", ["0"], ["r1", "r2&x=1"], "run id 'r2&x=1'"),
        ("http://h:5000", ["0"], ["r1", "r1"], "repeated: r1"),
        ("http://h:5000", [], ["r1", "r2"], "at least one experiment"),
        ("http://h:5000", [""], ["r1", "r2"], "experiment id ''"),
        ("localhost:5000", ["0"], ["r1", "r2"], "http(s) URL"),
        ("ftp://h/", ["0"], ["r1", "r2"], "http(s) URL"),
        ("http://", ["0"], ["r1", "r2"], "http(s) URL"),
        ("http://h:5000/#/experiments", ["0"], ["r1", "r2"], "query or #fragment"),
    ],
)
def test_compare_url_rejects_bad_input(
    ui_base: str, experiments: list[str], runs: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compare_url(ui_base, experiments, runs)


def test_ui_base_url_defaults_to_mlflow_ui_and_follows_env(monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_UI_URL", raising=False)
    assert ui_base_url() == "http://127.0.0.1:5000"
    monkeypatch.setenv("MLFLOW_UI_URL", "https://mlflow.example.org")
    assert ui_base_url() == "https://mlflow.example.org"


def test_resolve_runs_by_id_and_by_name_across_experiments(store: Store) -> None:
    refs = ["cpu-default-20261122-081500", store.ids["in-b"], "current"]

    runs = resolve_runs(store.uri, refs)

    assert [r.info.run_id for r in runs] == [
        store.ids["cpu-default-20261122-081500"],
        store.ids["in-b"],
        store.ids["current"],
    ]
    assert [r.info.experiment_id for r in runs] == [store.exp_a, store.exp_b, store.exp_a]


def test_resolve_runs_unknown_ref_is_named(store: Store) -> None:
    with pytest.raises(ValueError, match="'cpu-default-19990101-000000'"):
        resolve_runs(store.uri, ["current", "cpu-default-19990101-000000"])


def test_resolve_runs_ambiguous_name_lists_matching_ids(store: Store) -> None:
    with pytest.raises(ValueError, match="matches 2 runs") as err:
        resolve_runs(store.uri, ["current", "shared"])
    older, newer = store.shared_name_ids
    assert f"{newer}, {older}" in str(err.value)


def test_previous_run_skips_evaluation_unfinished_and_later_runs(store: Store) -> None:
    found = previous_run(store.uri, store.exp_a, store.ids["current"])

    assert found == store.ids["cpu-default-20261122-081500"]


def test_previous_run_of_the_first_run_is_none(store: Store) -> None:
    assert previous_run(store.uri, store.exp_a, store.ids["cpu-default-20261122-081500"]) is None


def test_cli_compare_prints_the_url_and_a_line_per_run(store: Store, capsys) -> None:
    code = cli.main(
        [
            "compare",
            "cpu-default-20261122-081500",
            store.ids["current"],
            "--tracking-uri",
            store.uri,
            "--ui",
            "http://mlflow.example.org:8080",
        ]
    )

    out, err = capsys.readouterr()
    assert code == 0
    assert (
        out
        == compare_url(
            "http://mlflow.example.org:8080",
            [store.exp_a],
            [store.ids["cpu-default-20261122-081500"], store.ids["current"]],
        )
        + "\n"
    )
    lines = err.splitlines()
    assert lines == [
        f"cpu-default-20261122-081500  {store.ids['cpu-default-20261122-081500']}  "
        "eval/accuracy=0.5",
        f"current  {store.ids['current']}  eval/accuracy=0.75",  # the last step's value
    ]


def test_cli_compare_defaults_come_from_env(store: Store, capsys, monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.uri)
    monkeypatch.setenv("MLFLOW_UI_URL", "http://ui.example:5000")

    code = cli.main(["compare", "later", "in-b"])

    out, err = capsys.readouterr()
    assert code == 0
    assert out.startswith("http://ui.example:5000/#/compare-runs?runs=")
    assert "later" in err and "eval/accuracy=not logged" in err


def test_cli_compare_unknown_run_exits_2_naming_it(store: Store, capsys) -> None:
    code = cli.main(["compare", "current", "nope-run", "--tracking-uri", store.uri])

    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert "'nope-run'" in err


def test_cli_compare_needs_two_runs(store: Store, capsys) -> None:
    code = cli.main(["compare", "current", "--tracking-uri", store.uri])

    out, err = capsys.readouterr()
    assert code == 2
    assert "at least two runs" in err
