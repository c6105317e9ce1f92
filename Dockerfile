# One image for the worker and the exporter; docker-compose.yml picks the command.
# The base brings Python and a CUDA build of torch, which satisfies pyproject's
# torch>=2.5, so pip keeps it and installs only the rest.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VRAMLEDGER_KERNELS_DIR=/opt/vramledger/kernels

# A C compiler (and OpenMP's runtime) for the CPU kernels, which are built below, once, for both
# instruction sets: a CPU worker started from the image compiles nothing.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libgomp1 \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/vramledger
COPY pyproject.toml README.md ./
COPY worker ./worker
COPY exporter ./exporter
COPY vramledger ./vramledger
# Not editable: the shipped tiny target/draft pair is installed as package data. The Kubernetes
# client is the exporter's --kubernetes (the DaemonSet).
RUN pip install '.[kubernetes]' \
 && python -c "import vramledger.worker, vramledger.exporter, pynvml, kubernetes" \
 && python -m vramledger.worker.kernels.native "$VRAMLEDGER_KERNELS_DIR"

# Worker API + /metrics on 8000, exporter /metrics on 9400.
EXPOSE 8000 9400

# The worker with the shipped tiny pair; pass --model/--draft-model for real ones.
CMD ["python", "-m", "vramledger.worker", "serve", "--host", "0.0.0.0", "--port", "8000"]
