"""Agents from the ecosystem: an OpenAI-compatible endpoint in front of a rollout engine, the
record of every call an episode's agent makes through it, and loading a user's agent function.

Parts: `request.py` (a request body checked: every field served, accepted or refused by name),
`chat.py` (rendering messages to prompt ids without re-tokenizing what the engine sampled, stop
strings, OpenAI response bodies), `toolcalls.py` (a reply's text -> OpenAI `tool_calls`, in the
format `env.tool_parser` names), `streaming.py` (a response body -> server-sent events),
`recorder.py` (calls -> token-exact trajectories and
their segments), `batcher.py` (concurrent calls -> batched `engine.generate`), `server.py` (the
HTTP endpoint, loopback and a bearer token), `agent.py` (a user's 'module:function' and what it
returns). The rollout role wires them (roles/agents.py).

May import: config, rollout.
"""
