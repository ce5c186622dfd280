# syntax=docker/dockerfile:1
# Crucible's GPU worker (and, with another command, the Ray head of a compose deployment):
#
#   docker build -f deploy/docker/gpu.Dockerfile -t crucible-worker-gpu .
#   docker build -f deploy/docker/gpu.Dockerfile --build-arg WITH_SANDBOX=1 -t crucible-worker-gpu-sandbox .
#
# Installs the project's dependencies with the extras a GPU pool needs: rl (torch, DeepSpeed,
# transformers), envs, sandbox, gpu (vLLM) and cluster (Ray; the extra comes with the multi-node
# work of issue 21, item 1). Written and checked statically (tests/deploy/test_docker.py); it was
# not built on the machine that wrote it (no Docker engine, no network to the registries):
# whether pip finds a vLLM release that accepts the rl extra's torch==2.13.0 is decided at
# build time. See docs/deploy.md.
#
# The base is NVIDIA's CUDA *devel* image (nvcc and headers), not the runtime one: DeepSpeed
# compiles some of its ops just in time on the first run (workers/rl/engine.py sets
# TORCH_CUDA_ARCH_LIST for it), which needs nvcc at run time. Its CUDA major version must match
# the one torch was built for (python -c "import torch; print(torch.version.cuda)"). Ubuntu
# 24.04's Python is 3.12 (Crucible supports 3.11 and newer). Pinned by tag and digest; the digest
# is the one several independent public projects pin for this tag, not resolved against the
# registry here. Check it with: docker buildx imagetools inspect nvidia/cuda:13.0.3-cudnn-devel-ubuntu24.04
ARG CUDA_IMAGE=nvidia/cuda:13.0.3-cudnn-devel-ubuntu24.04@sha256:0230b7f243483cb15969fa3cc724a9459599604427052fc2a0d4291c7c0647dd

# ---------------------------------------------------------------------------------------------
# Dependencies into /opt/venv (the build stage keeps pip's downloads and build trees out of the
# final image).
FROM ${CUDA_IMAGE} AS deps
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
RUN mkdir -p config apps workers && touch config/__init__.py apps/__init__.py workers/__init__.py \
    && pip install --upgrade pip \
    && pip install ".[rl,envs,sandbox,gpu,cluster]" \
    && pip uninstall -y crucible

# ---------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS worker-gpu
# 1: also install the sandbox (bubblewrap, toolchains, gate) for train runs whose environments
# execute code; such a container must then run as root with the sandbox's privileges, like the
# sandbox worker (docs/deploy.md).
ARG WITH_SANDBOX=0
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app \
    CRUCIBLE_VAR_DIR=/var/lib/crucible \
    CRUCIBLE_WORKER_QUEUES=gpu CRUCIBLE_WORKER_CONCURRENCY=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
# A C/C++ compiler and Python's headers: DeepSpeed's just-in-time op builds need them with nvcc.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 crucible \
    && useradd --system --uid 10001 --gid crucible --home-dir /var/lib/crucible \
       --shell /usr/sbin/nologin crucible \
    && install -d -o crucible -g crucible -m 0750 /var/lib/crucible
COPY --from=deps /opt/venv /opt/venv
WORKDIR /app
COPY manage.py pyproject.toml ./
COPY config ./config
COPY apps ./apps
COPY workers ./workers
COPY deploy/docker/healthcheck.py deploy/docker/worker.sh ./deploy/docker/
COPY scripts/install_sandbox_deps.sh ./scripts/install_sandbox_deps.sh
RUN if [ "$WITH_SANDBOX" = 1 ]; then bash scripts/install_sandbox_deps.sh && rm -rf /var/lib/apt/lists/*; fi
VOLUME ["/var/lib/crucible"]
USER 10001:10001
# Ray's head and the GPU worker share this image: 6379 (GCS), 8265 (dashboard and Jobs API),
# 10001 (Ray client) matter only for the head.
EXPOSE 6379 8265 10001
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ["python", "-m", "workers.health"]
CMD ["/app/deploy/docker/worker.sh"]
