"""The Flyte 2 entry point (the `flyte2` extra): train.py runs a whole RL run as Flyte 2 tasks,
asks.py turns relax_core/ops/asks.py's asks into Flyte 2's per-call overrides.

The task bodies are tasks/bodies.py's, the ones the flytekit tasks of tasks/rl.py call; a Flyte 1
cluster (flytekit, workflows/) cannot run this code, nor a Flyte 2 backend the flytekit workflows.
May import: relax_core, tasks (bodies, the Kubernetes pods, the registration config), flyte.
"""
