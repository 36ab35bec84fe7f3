# A conveyor image (CPU): `docker compose up` uses it for the make-model, worker and gateway
# services. Every `conveyor` verb works: `docker run IMAGE worker --model ... --redis ...`.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The CPU build of torch first, from PyTorch's CPU wheel index: the default wheel brings CUDA
# (gigabytes). Installing conveyor afterwards keeps it, since it satisfies torch>=2.4.
RUN pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu

# A C++ compiler for the CPU attention kernel, built on first use for the CPU the container
# runs on (worker/host/cpu_kernels.py); without it decodes take the slower torch path.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

COPY pyproject.toml README.md ./
COPY producer ./producer
COPY worker ./worker
COPY scheduler ./scheduler
COPY kvstore ./kvstore
RUN pip install ".[worker,gateway]"

# Prometheus metrics, when a worker runs with --metrics-port 9400 (docker-compose.yml does);
# the gateway's HTTP API (and its /metrics) on 8000.
EXPOSE 9400 8000

ENTRYPOINT ["conveyor"]
CMD ["--help"]
