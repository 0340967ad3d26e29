"""The engine: what the worker thread serves (engine.py), the worker's queue and rounds
(worker.py), the batched decode and budgeted prefill (batcher.py), one request's
generation (generation.py), the jobs the API hands over (jobs.py, no MLX) and metrics."""
