"""The OpenAI-compatible server: app, worker, sessions, model loading and the CLI."""
