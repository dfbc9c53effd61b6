"""Agents from the ecosystem: an OpenAI-compatible endpoint in front of a rollout engine, the
record of every call an episode's agent makes through it, and loading a user's agent function.

Parts: `chat.py` (request checks, rendering messages to prompt ids without re-tokenizing what the
engine sampled, OpenAI response bodies), `recorder.py` (calls -> token-exact trajectories and
their segments), `batcher.py` (concurrent calls -> batched `engine.generate`), `server.py` (the
HTTP endpoint, loopback and a bearer token), `agent.py` (a user's 'module:function' and what it
returns). The rollout role wires them (roles/agents.py).

May import: config, rollout.
"""
