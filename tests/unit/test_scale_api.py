"""The elastic rollout API over real HTTP on loopback: authentication, validation, one operation at
a time, idempotent targets, protected startup engines, cancel. A rejected request must change
nothing: neither the pool file every role reads nor the engines started.

The launcher side is a recording host (start requests and process states), so these tests run in
a second; tests/integration/test_elastic.py drives the same API against a real run.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from relax_core.config import RunConfig, replace
from relax_core.ops.elastic import ElasticPool
from relax_core.ops.scale_api import ScaleServer, write_api_file
from relax_core.pool.engines import POOL, external_engines, weight_members
from relax_core.queue import TransferQueue
from tests.s3servers import free_ports

TOKEN = "s3cret-token"
(DEAD_PORT,) = free_ports(1)


class RecordingHost:
    """The launcher's side: which engines were asked to start; their processes' states."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.procs: dict[str, tuple[int, int | None]] = {"rollout-0": (100, None)}

    def start_engine(self, worker: int) -> None:
        self.started.append(worker)
        self.procs[f"rollout-{worker}"] = (1000 + len(self.started), None)

    def engine_process(self, name: str):
        return self.procs.get(name)


@pytest.fixture
def api(tmp_path):
    cfg = replace(RunConfig(), mode="async", services={"max_rollout_workers": 4})
    queue = TransferQueue(str(tmp_path / "q"), "run")
    host = RecordingHost()
    pool = ElasticPool(cfg, queue, host)
    server = ScaleServer(pool, "127.0.0.1", 0, TOKEN)
    yield server, pool, host, queue, cfg
    server.close()


def call(server, method, path, body=None, token=TOKEN, raw: bytes | None = None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    req = urllib.request.Request(server.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.load(resp), resp.headers
    except urllib.error.HTTPError as err:
        return err.code, json.load(err), err.headers


def _taking_work(pool, host, *names):
    """The engines' heartbeats say they hold the trainer's weights and take work."""
    beats = {n: {"info": {"pid": host.procs[n][0], "taking_work": True}} for n in names}
    pool.tick(beats)


def test_it_binds_loopback_and_writes_a_private_api_file(api, tmp_path):
    server, *_ = api
    assert server.url.startswith("http://127.0.0.1:")
    path = write_api_file(str(tmp_path), server.url, TOKEN)
    assert os.stat(path).st_mode & 0o777 == 0o600
    with open(path) as f:
        assert json.load(f)["url"] == server.url


@pytest.mark.parametrize("token", [None, "wrong", ""])
def test_requests_without_the_token_are_refused_and_change_nothing(api, token):
    server, pool, host, queue, cfg = api
    before = queue.store.read_bytes(POOL)
    for method, path, body in [
        ("GET", "/engines", None),
        ("POST", "/scale_out", {"target": 3}),
        ("POST", "/scale_in", {"target": 1}),
    ]:
        code, answer, headers = call(server, method, path, body, token=token)
        assert code == 401 and "bearer token" in answer["error"]
        assert headers["WWW-Authenticate"].startswith("Bearer")
    pool.tick({})
    assert host.started == [] and queue.store.read_bytes(POOL) == before
    assert weight_members(cfg, queue) == ["rollout-0"]


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/scale_out", b"{target: 3", "the body is not JSON"),
        ("/scale_out", b"[3]", "must be a JSON object"),
        ("/scale_out", {"target": "3"}, 'target must be an integer, got "3"'),
        ("/scale_out", {"target": True}, "target must be an integer, got true"),
        ("/scale_out", {"target": 9}, "target must be 1..4, got 9"),
        ("/scale_out", {"target": 2, "fast": 1}, "unknown field(s) ['fast']"),
        ("/scale_out", {}, 'exactly one of "target"'),
        ("/scale_out", {"engines": ["http://10.0.0.7:30000"]}, "unknown field(s) ['engines']"),
        ("/scale_out", {"urls": "http://10.0.0.7:30000"}, "must be a non-empty list"),
        ("/scale_out", {"urls": ["ftp://10.0.0.7"]}, "not an http(s)://host:port URL"),
        ("/scale_out", {"urls": ["http://a:1", "http://a:1/"]}, "names a server twice"),
        ("/scale_out", {"target": 2, "urls": ["http://a:1"]}, 'exactly one of "target"'),
        ("/scale_out", {"urls": [f"http://127.0.0.1:{DEAD_PORT}"]}, "does not answer as an SGLang"),
        ("/scale_in", {}, 'exactly one of "target"'),
        ("/scale_in", {"target": 1, "engines": ["rollout-0"]}, 'exactly one of "target"'),
        ("/scale_in", {"engines": ["rollout-0"]}, "started with the run and are protected"),
        ("/scale_in", {"engines": ["rollout-7"]}, "['rollout-7'] not in the pool"),
        ("/scale_in", {"engines": "rollout-0"}, "must be a non-empty list"),
    ],
)
def test_malformed_or_impossible_requests_get_400_and_change_nothing(api, path, body, message):
    server, pool, host, queue, _ = api
    before = queue.store.read_bytes(POOL)
    raw = body if isinstance(body, bytes) else None
    code, answer, _ = call(server, "POST", path, None if raw else body, raw=raw)
    assert code == 400 and message in answer["error"], answer
    pool.tick({})
    assert host.started == [] and queue.store.read_bytes(POOL) == before
    assert call(server, "GET", "/engines")[1]["operation"] is None


def test_startup_engines_are_protected(tmp_path):
    cfg = replace(RunConfig(), mode="async", services={"rollout_workers": 2})
    pool = ElasticPool(cfg, TransferQueue(str(tmp_path), "r"), RecordingHost())
    server = ScaleServer(pool, "127.0.0.1", 0, TOKEN)
    try:
        code, answer, _ = call(server, "POST", "/scale_in", {"target": 1})
        assert code == 400 and "(rollout-0, rollout-1) are protected" in answer["error"]
        code, answer, _ = call(server, "POST", "/scale_in", {"target": 2})
        assert code == 200 and answer["id"] is None  # nothing to remove
    finally:
        server.close()


def test_scale_out_then_in_one_operation_at_a_time_with_idempotent_targets(api):
    server, pool, host, queue, cfg = api
    code, op, _ = call(server, "POST", "/scale_out", {"target": 3})
    assert code == 202 and op["engines"] == ["rollout-1", "rollout-2"] and op["status"] == "running"
    # The same request again (a client retry) is the same operation; another one must wait.
    code, again, _ = call(server, "POST", "/scale_out", {"target": 3})
    assert code == 200 and again["id"] == op["id"]
    for path, body in [("/scale_out", {"target": 4}), ("/scale_in", {"target": 1})]:
        code, answer, _ = call(server, "POST", path, body)
        assert code == 409 and answer["operation"]["id"] == op["id"]

    pool.tick({})  # the launcher starts them; they are not in weight sync's way until they wait
    assert host.started == [1, 2]
    assert weight_members(cfg, queue) == ["rollout-0", "rollout-1", "rollout-2"]
    assert call(server, "GET", op["url"])[1]["status"] == "running"
    _taking_work(pool, host, "rollout-1")
    assert call(server, "GET", op["url"])[1]["status"] == "running"  # rollout-2 still syncing
    _taking_work(pool, host, "rollout-1", "rollout-2")
    assert call(server, "GET", op["url"])[1]["status"] == "succeeded"
    code, answer, _ = call(server, "POST", "/scale_out", {"target": 2})
    assert code == 200 and answer["id"] is None and "none to add" in answer["message"]

    code, op, _ = call(server, "POST", "/scale_in", {"target": 1})
    assert code == 202 and op["engines"] == ["rollout-2", "rollout-1"]  # newest first
    # Out of weight sync at once, asked to drain, and removed only once they exit cleanly.
    assert weight_members(cfg, queue) == ["rollout-0"]
    assert queue.store.exists("control/drain/rollout-1")
    host.procs["rollout-2"] = (host.procs["rollout-2"][0], 0)
    pool.tick({})
    engines = {e["name"]: e["state"] for e in call(server, "GET", "/engines")[1]["engines"]}
    assert engines == {"rollout-0": "active", "rollout-1": "draining", "rollout-2": "removed"}
    host.procs["rollout-1"] = (host.procs["rollout-1"][0], 0)
    pool.tick({})
    assert call(server, "GET", op["url"])[1]["status"] == "succeeded"
    # Worker numbers are never reused: the next engine is rollout-3.
    code, op, _ = call(server, "POST", "/scale_out", {"target": 2})
    assert op["engines"] == ["rollout-3"]


def test_cancel_stops_engines_not_yet_taking_work_and_keeps_draining_ones(api):
    server, pool, host, queue, cfg = api
    _, op, _ = call(server, "POST", "/scale_out", {"target": 3})
    pool.tick({})
    _taking_work(pool, host, "rollout-1")
    code, cancelled, _ = call(server, "POST", op["url"] + "/cancel")
    assert code == 200 and cancelled["status"] == "cancelling"
    assert weight_members(cfg, queue) == ["rollout-0", "rollout-1"]
    assert queue.store.exists("control/drain/rollout-2")
    host.procs["rollout-2"] = (host.procs["rollout-2"][0], 0)  # it saw the drain and exited
    pool.tick({})
    assert call(server, "GET", op["url"])[1]["status"] == "cancelled"
    code, answer, _ = call(server, "POST", op["url"] + "/cancel")
    assert code == 409 and "nothing to cancel" in answer["error"]

    _, op, _ = call(server, "POST", "/scale_in", {"engines": ["rollout-1"]})
    code, cancelled, _ = call(server, "POST", op["url"] + "/cancel")
    assert code == 200 and cancelled["status"] == "cancelled"
    assert weight_members(cfg, queue) == ["rollout-0", "rollout-1"]
    assert not queue.store.exists("control/drain/rollout-1")


def test_unknown_paths_operations_and_methods(api):
    server, *_ = api
    assert call(server, "GET", "/scale_out/op-nope")[0] == 404
    assert call(server, "POST", "/scale_in/op-nope/cancel")[0] == 404
    assert call(server, "GET", "/nodes")[0] == 404
    code, answer, _ = call(server, "DELETE", "/engines")
    assert code == 405 and "takes GET" in answer["error"]
    assert call(server, "GET", "/scale_out")[0] == 405


def test_relax_scale_shows_grows_and_explains_a_missing_run(api, tmp_path, capsys):
    from relax_core.entrypoints.cli import main

    server, pool, host, queue, _ = api
    run_dir = tmp_path / "run-1"
    run_dir.mkdir()
    write_api_file(str(run_dir), server.url, TOKEN)
    assert main(["scale", str(run_dir)]) == 0
    assert capsys.readouterr().out.split()[:3] == ["rollout-0", "active", "startup"]
    assert main(["scale", str(run_dir), "--out", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["engines"] == ["rollout-1"]
    assert main(["scale", str(run_dir), "--in", "1"]) == 2  # 409: the scale-out still runs
    assert "HTTP 409" in capsys.readouterr().err
    assert main(["scale", str(run_dir), "--cancel"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "cancelling"
    assert main(["scale", str(tmp_path / "gone")]) == 2
    assert "scale_api.json does not exist" in capsys.readouterr().err


@pytest.fixture
def sglang_health():
    """A paused SGLang server's answers: GET /ready 200 (it is up; 0.5.23's cheap check),
    GET /health 503 (0.5.23 generates a token there, and answers 503 while paused)."""

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response({"/ready": 200, "/health": 503}.get(self.path, 404))
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_registering_sglang_servers_by_url(api, sglang_health):
    server, pool, host, queue, cfg = api
    body = {"urls": [sglang_health + "/"]}
    code, op, _ = call(server, "POST", "/scale_out", body)
    assert code == 202 and op["engines"] == ["rollout-1"] and op["target"] == 2
    assert call(server, "POST", "/scale_out", body)[:2] == (200, op)  # a retry: the same op
    pool.tick({})
    assert host.started == [1]  # its rollout process, which drives the server over HTTP
    # Weights reach it through SGLang's group, not the broadcast group.
    assert weight_members(cfg, queue) == ["rollout-0"]
    assert external_engines(cfg, queue) == [("rollout-1", sglang_health)]
    _taking_work(pool, host, "rollout-1")
    assert call(server, "GET", f"/scale_out/{op['id']}")[1]["status"] == "succeeded"
    code, answer, _ = call(server, "POST", "/scale_out", {"urls": [sglang_health]})
    assert code == 200 and answer["id"] is None and "already" in answer["message"]
    code, op, _ = call(server, "POST", "/scale_in", {"engines": ["rollout-1"]})
    assert code == 202 and external_engines(cfg, queue) == []


def test_registering_urls_needs_the_broadcast_transport(tmp_path, sglang_health):
    cfg = replace(RunConfig(), mode="async", services={"weight_sync": "object_store"})
    queue = TransferQueue(str(tmp_path / "q"), "run")
    server = ScaleServer(ElasticPool(cfg, queue, RecordingHost()), "127.0.0.1", 0, TOKEN)
    try:
        code, answer, _ = call(server, "POST", "/scale_out", {"urls": [sglang_health]})
        assert code == 400 and "services.weight_sync 'broadcast'" in answer["error"]
    finally:
        server.close()
