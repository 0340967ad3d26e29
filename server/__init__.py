"""The OpenAI-compatible server: app, worker, sessions, model loading and the CLI."""

from server.own_packages import claim

# Before anything imports `kernels`, `config`, ...: the project's own packages win over
# installed distributions of the same names (server/own_packages.py).
claim()
