"""The service of each async-mode role, by name: what a Flyte role task or
`python -m relax_core.entrypoints.role` serves.

A role process imports only its own service: the reference and actor-forward roles bring
transformers' model code (with it scipy and sympy, ~3 s of CPU per process on the test machine),
which the advantages role never uses."""

from __future__ import annotations

from collections.abc import Callable

from relax_core.roles.service import ROLES, RoleContext


def _rollout(ctx: RoleContext) -> None:
    from relax_core.roles import rollout_service

    rollout_service.serve(ctx)


def _reference(ctx: RoleContext) -> None:
    from relax_core.roles import reference

    reference.serve(ctx)


def _actor_fwd(ctx: RoleContext) -> None:
    from relax_core.roles import actor_fwd

    actor_fwd.serve(ctx)


def _advantages(ctx: RoleContext) -> None:
    from relax_core.roles import advantages

    advantages.serve(ctx)


def _trainer(ctx: RoleContext) -> None:
    from relax_core.roles import trainer_service

    trainer_service.serve(ctx)


SERVES: dict[str, Callable[[RoleContext], None]] = {
    "rollout": _rollout,
    "reference": _reference,
    "actor_fwd": _actor_fwd,
    "advantages": _advantages,
    "trainer": _trainer,
}
assert tuple(SERVES) == ROLES


def serve_fn(role: str) -> Callable[[RoleContext], None]:
    """The `serve` function of `role`."""
    if role not in SERVES:
        raise ValueError(f"unknown role {role!r}; roles are {list(SERVES)}")
    return SERVES[role]
