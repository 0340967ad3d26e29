"""The HTTP surface: the FastAPI app, OpenAI protocol types, routes, streaming, errors,
auth, the chat page and its cache view. Imports no MLX (the app loads OpenBLAS first)."""
