"""An OpenEnv environment (openenv-core 0.3.0) run unchanged as an Env: the shipped env 'openenv'.

OpenEnv is Meta/HF's environment standard: an `Environment` subclass with reset/step over typed
pydantic Action/Observation models, run in process or served by its FastAPI app (`create_app`),
whose WebSocket endpoint gives each client session its own env instance. Parts:
- OpenEnvSettings (openenv_settings.py): the string kwargs of `env.kwargs`, parsed and checked;
- a session per episode: _LocalSession builds the `env` class ('module:Class') in this process,
  _RemoteSession opens one WebSocket session on `url` with OpenEnv's GenericEnvClient;
- _Fields: which field of an Action takes the turn text and which Observation field is shown,
  read from the pydantic model (in process) or from the server's GET /schema;
- OpenEnvEnv ties them to the Env protocol: turn text -> Action, Observation -> (text, reward
  None -> 0.0, done, metadata as info, `correct` on the step that ends the episode).
The session ends when the env says done, when a call fails, or when the loop drops the env.
Install, config and limits: docs/openenv.md.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import typing
import urllib.request
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from relax_core.envs.openenv_settings import OpenEnvSettings
from relax_core.envs.protocol import INFO_CORRECT, StepResult
from relax_core.user_code import import_attribute

INSTALL = "pip install 'relax-flyte[openenv]' && pip install --no-deps openenv-core==0.3.0"
"""openenv-core declares gradio, whose pillow<13 pin conflicts with ours: hence --no-deps."""
RESERVED = frozenset({"done", "reward", "metadata"})
"""Fields every OpenEnv Action/Observation has; never the turn text or the shown text."""


class OpenEnvServerError(RuntimeError):
    """An OpenEnv server could not be reached or answered with an error; names the URL."""


def openenv_core() -> Any:
    """The `openenv.core` module; ModuleNotFoundError with the install line when absent."""
    try:
        import openenv.core as core
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"env 'openenv' needs openenv-core 0.3.0 and its runtime dependencies "
            f"(module {e.name!r} is missing): {INSTALL}"
        ) from e
    return core


@dataclass(frozen=True)
class _Fields:
    """The fields of an Action or Observation type besides done/reward/metadata."""

    type_name: str
    names: tuple[str, ...]
    text: tuple[str, ...]
    """Fields declared as strings."""
    required: tuple[str, ...]

    @classmethod
    def of_model(cls, model: type) -> _Fields:
        fields = {n: f for n, f in model.model_fields.items() if n not in RESERVED}
        text = [n for n, f in fields.items() if _is_str(f.annotation)]
        required = [n for n, f in fields.items() if f.is_required()]
        return cls(model.__name__, tuple(fields), tuple(text), tuple(required))

    @classmethod
    def of_schema(cls, schema: Mapping[str, Any]) -> _Fields:
        props = {n: p for n, p in schema.get("properties", {}).items() if n not in RESERVED}
        text = [n for n, p in props.items() if _is_str_schema(p)]
        required = [n for n in schema.get("required", ()) if n in props]
        return cls(str(schema.get("title", "?")), tuple(props), tuple(text), tuple(required))

    def action_field(self, wanted: str) -> str:
        """The field that takes the turn text: `wanted`, else the only string field."""
        name = wanted or (self.text[0] if len(self.text) == 1 else "")
        if not name:
            raise ValueError(
                f"action {self.type_name} has {len(self.text)} string field(s) "
                f"({', '.join(self.text) or 'none'}); name one with env.kwargs.action_field or "
                "write env.kwargs.action_builder ('module:function', text -> action)"
            )
        self._require(name, "action_field")
        others = [n for n in self.required if n != name]
        if others:
            raise ValueError(
                f"action {self.type_name} also requires {', '.join(others)}; write "
                "env.kwargs.action_builder ('module:function', text -> action)"
            )
        return name

    def observation_field(self, wanted: str) -> str:
        """The field shown to the model: `wanted`, else the only string field, else '' (all)."""
        if wanted:
            self._require(wanted, "observation_field")
            return wanted
        return self.text[0] if len(self.text) == 1 else ""

    def _require(self, name: str, kwarg: str) -> None:
        if name not in self.names:
            raise ValueError(
                f"env.kwargs.{kwarg}: {self.type_name} has no field {name!r}; its fields: "
                f"{', '.join(self.names) or 'none'}"
            )


def _is_str(annotation: Any) -> bool:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return annotation is str or (bool(args) and all(a is str for a in args))


def _is_str_schema(prop: Mapping[str, Any]) -> bool:
    options = [o for o in prop.get("anyOf", [prop]) if o.get("type") != "null"]
    return bool(options) and all(o.get("type") == "string" for o in options)


@dataclass(frozen=True)
class _Outcome:
    """What reset/step returned, the same in process and over the wire."""

    fields: dict[str, Any]
    reward: float | None
    done: bool
    metadata: dict[str, Any]
    shown: str
    """The Observation field to show ('' = all fields as JSON)."""

    def text(self) -> str:
        if self.shown and self.shown not in self.fields:
            raise ValueError(
                f"env.kwargs.observation_field: the observation has no field {self.shown!r}; "
                f"its fields: {', '.join(self.fields) or 'none'}"
            )
        value = self.fields[self.shown] if self.shown else self.fields
        if value is None or isinstance(value, str):
            return value or ""
        return json.dumps(value, sort_keys=True, default=str)


class _LocalSession:
    """One Environment instance in this process."""

    def __init__(self, env_cls: type, env_args: dict[str, Any], shown: str) -> None:
        self.env_cls, self.env_args, self.wanted = env_cls, env_args, shown
        self.env: Any = None

    @property
    def open(self) -> bool:
        return self.env is not None

    def reset(self, kwargs: dict[str, Any]) -> _Outcome:
        self.close()
        self.env = self.env_cls(**self.env_args)
        # As OpenEnv's server does: only the keywords reset() takes.
        params = inspect.signature(self.env.reset).parameters.values()
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            names = {p.name for p in params}
            kwargs = {k: v for k, v in kwargs.items() if k in names}
        return self._outcome(self.env.reset(**kwargs))

    def step(self, action: Any) -> _Outcome:
        return self._outcome(self.env.step(action))

    def _outcome(self, obs: Any) -> _Outcome:
        if not hasattr(obs, "model_dump"):
            raise TypeError(
                f"{self.env_cls.__name__} returned a {type(obs).__name__}, not an Observation"
            )
        shown = _Fields.of_model(type(obs)).observation_field(self.wanted)
        fields = obs.model_dump(exclude=set(RESERVED))
        return _Outcome(fields, obs.reward, bool(obs.done), dict(obs.metadata), shown)

    def close(self) -> None:
        env, self.env = self.env, None
        if env is not None:
            env.close()


class _RemoteSession:
    """One WebSocket session (one env instance) on an OpenEnv server."""

    def __init__(self, url: str, timeout_s: float, shown: str) -> None:
        self.url, self.timeout_s, self.shown = url, timeout_s, shown
        self.client: Any = None

    @property
    def open(self) -> bool:
        return self.client is not None

    def schema(self) -> dict[str, Any]:
        """The server's GET /schema: JSON schemas of its action and observation types."""
        http = self.url.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
        try:
            with urllib.request.urlopen(f"{http}/schema", timeout=self.timeout_s) as answer:
                return json.load(answer)
        except Exception as e:  # noqa: BLE001 - any failure is the server's, named by URL
            raise self._error("GET /schema", e) from e

    def reset(self, kwargs: dict[str, Any]) -> _Outcome:
        self.close()
        client = openenv_core().GenericEnvClient(
            base_url=self.url, connect_timeout_s=self.timeout_s, message_timeout_s=self.timeout_s
        )
        self.client = client.sync()
        return self._call("reset", self.client.reset, **kwargs)

    def step(self, action: dict[str, Any]) -> _Outcome:
        return self._call("step", self.client.step, action)

    def _call(self, phase: str, method: Callable[..., Any], *args: Any, **kw: Any) -> _Outcome:
        try:
            result = method(*args, **kw)
        except Exception as e:  # noqa: BLE001 - any failure is the server's, named by URL
            self.close()
            raise self._error(phase, e) from e
        # openenv-core 0.3.0 leaves the Observation's metadata off the wire.
        fields = dict(result.observation or {})
        return _Outcome(fields, result.reward, bool(result.done), {}, self.shown)

    def _error(self, phase: str, e: Exception) -> OpenEnvServerError:
        """The failure named by URL, what it likely means first (EnvFailure keeps 500 chars)."""
        why = ""
        if isinstance(e, TimeoutError):
            why = f" (no answer within env.kwargs.timeout_s={self.timeout_s:g})"
        elif isinstance(e, OSError):  # refused, unresolvable
            why = " (the server is unreachable: is it running, and is the url right?)"
        elif "CAPACITY_REACHED" in str(e) or type(e).__name__.startswith("ConnectionClosed"):
            # A server at its session limit answers a new session by closing it.
            why = (
                " (the server closed the session: it stopped, or it holds fewer sessions than "
                "episodes in flight; build its app with max_concurrent_envs >= the episodes "
                "of a rollout step or an evaluation)"
            )
        return OpenEnvServerError(f"OpenEnv server {self.url}: {phase} failed{why}: {e}")

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):  # the session is over either way
                client.close()


class OpenEnvEnv:
    """One episode of an OpenEnv environment, in process (`env`) or on a server (`url`)."""

    def __init__(self, **kwargs: Any) -> None:
        s = self.settings = OpenEnvSettings.from_kwargs(kwargs)
        core = openenv_core()
        self._builder: Callable[[str], Any] | None = None
        if s.action_builder:
            self._builder = _user_function(s.action_builder, "env.kwargs.action_builder")
        self._action_cls: type | None = None
        self._action_field = s.action_field
        self._session: _LocalSession | _RemoteSession
        if s.env:
            env_cls = _environment_class(s.env, s.env_args, core)
            self._action_cls = _action_type(env_cls, s.action_cls, core)
            if not self._builder:
                self._action_field = _Fields.of_model(self._action_cls).action_field(s.action_field)
            self._session = _LocalSession(env_cls, s.env_args, s.observation_field)
        else:
            self._session = _RemoteSession(s.url, s.timeout_s, s.observation_field)
        # The loop does not tell an env that its episode ended on max_turns or the token budget;
        # dropping the env then ends its session.
        self._close = weakref.finalize(self, self._session.close)

    def reset(self, sample: Mapping[str, Any]) -> str | None:
        meta = sample.get("meta") or {}
        kwargs = {k: meta[k] for k in self.settings.reset_keys if k in meta}
        if isinstance(self._session, _RemoteSession):
            self._read_schema(self._session)
        text = self._session.reset(kwargs).text()
        return text if self.settings.show_reset and text.strip() else None

    def step(self, action_text: str) -> StepResult:
        if not self._session.open:
            raise RuntimeError("step() before reset() or after the episode ended")
        out = self._session.step(self._action(action_text))
        reward = 0.0 if out.reward is None else float(out.reward)
        info = dict(out.metadata)
        if out.done:
            info[INFO_CORRECT] = self._correct(out, reward)
            self.close()
        return StepResult(out.text(), reward, out.done, info)

    def format_observation(self, observation: Any) -> dict[str, Any]:
        return {"role": self.settings.role, "content": str(observation)}

    def close(self) -> None:
        """End the episode's session (idempotent; also runs when the env is dropped)."""
        self._close()

    def _read_schema(self, session: _RemoteSession) -> None:
        """Fill in the action and observation fields the kwargs left to the server's types."""
        need_action = not (self._builder or self._action_field)
        if not need_action and session.shown:
            return
        schema = session.schema()
        try:
            if need_action:
                action = _Fields.of_schema(schema.get("action", {}))
                self._action_field = action.action_field("")
            session.shown = _Fields.of_schema(schema.get("observation", {})).observation_field(
                self.settings.observation_field
            )
        except ValueError as e:
            raise OpenEnvServerError(f"OpenEnv server {session.url}: {e}") from None

    def _action(self, text: str) -> Any:
        built = self._builder(text) if self._builder else {self._action_field: text}
        cls = self._action_cls
        if cls is not None and isinstance(built, cls):
            return built
        if isinstance(built, Mapping):
            return dict(built) if cls is None else cls.model_validate(dict(built))
        if cls is None and hasattr(built, "model_dump"):  # a server takes the action's fields
            return built.model_dump()
        raise TypeError(
            f"env.kwargs.action_builder {self.settings.action_builder!r} returned a "
            f"{type(built).__name__}; expected an Action or a dict of its fields"
        )

    def _correct(self, out: _Outcome, reward: float) -> bool:
        key = self.settings.correct_key
        if not key:
            threshold = self.settings.success_reward
            return threshold is not None and reward >= threshold
        for source in (out.metadata, out.fields):
            if key in source:
                return bool(source[key])
        wire = (
            " (metadata does not cross the wire in openenv-core 0.3.0)" if self.settings.url else ""
        )
        raise ValueError(
            f"env.kwargs.correct_key {key!r} is in neither the final observation's metadata "
            f"nor its fields ({', '.join(out.fields) or 'none'}){wire}"
        )


def _user_function(spec: str, what: str) -> Callable[[str], Any]:
    target = import_attribute(spec, what, "'module:function', e.g. 'my_pkg.actions:to_action'")
    if not callable(target):
        raise ValueError(f"{what}: {spec!r} is a {type(target).__name__}, not a function")
    return typing.cast(Callable[[str], Any], target)


def _environment_class(spec: str, env_args: dict[str, Any], core: Any) -> type:
    env_cls = import_attribute(spec, "env.kwargs.env", "'module:Class'")
    if not (isinstance(env_cls, type) and issubclass(env_cls, core.Environment)):
        raise ValueError(f"env.kwargs.env: {spec!r} is not an OpenEnv Environment subclass")
    try:
        inspect.signature(env_cls).bind(**env_args)
    except TypeError as e:
        raise ValueError(f"env.kwargs.env_args: {env_cls.__name__} cannot take them: {e}") from None
    return env_cls


def _action_type(env_cls: type, spec: str, core: Any) -> type:
    """The env's Action: `spec`, else X of an Environment[X, ...] base, else the annotation of
    step()'s `action` parameter."""

    def is_action(found: Any) -> bool:
        return (
            isinstance(found, type) and issubclass(found, core.Action) and found is not core.Action
        )

    if spec:
        found = import_attribute(spec, "env.kwargs.action_cls", "'module:Class'")
        if not is_action(found):
            raise ValueError(f"env.kwargs.action_cls: {spec!r} is not an OpenEnv Action subclass")
        return typing.cast(type, found)
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if typing.get_origin(base) is core.Environment and args and is_action(args[0]):
                return typing.cast(type, args[0])
    try:
        found = typing.get_type_hints(env_cls.step).get("action")
    except Exception:  # noqa: BLE001 - an annotation that does not resolve names nothing
        found = None
    if is_action(found):
        return typing.cast(type, found)
    raise ValueError(
        f"env.kwargs.action_cls: cannot tell the Action type of {env_cls.__name__} from its bases "
        "(Environment[MyAction, ...]) or its step() annotation; name it: "
        "action_cls: 'module:MyAction'"
    )
