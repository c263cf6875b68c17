# One image for the API and the workers. The GPU worker uses the CUDA build of
# torch (TORCH_INDEX); the default is the CPU build.
# The patch version is pinned: it is part of every target (python=3.11.7), and
# a floating tag would move the workers' target under the artifacts built for it.
# scripts/pin_images.sh replaces the tag by tag@sha256:... on a host that can
# reach the registry (docs/operations.md, "Images pinned by version, not by digest").
# PYTHON_IMAGE names the same version (tests/unit/test_compose.py checks it).
ARG PYTHON_VERSION=3.11.7
ARG PYTHON_IMAGE=python:3.11.7-slim
FROM ${PYTHON_IMAGE}
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
# bubblewrap: the build sandbox (farm.build.sandbox); setpriv comes with util-linux.
# g++: Inductor's C++ kernels and AOTI packages on CPU. A CUDA worker's AOTI
# packages need nvcc and the CUDA headers as well, which this image does not
# have (docs/operations.md, "The GPU worker's image"); the worker's start-up
# check prints whether AOTI packages build and load there.
RUN apt-get update && apt-get install -y --no-install-recommends g++ curl bubblewrap \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY farm farm
COPY registry registry
COPY workers workers
COPY migrations migrations
COPY server/pyproject.toml server/pyproject.toml
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "$TORCH_SPEC" \
 && pip install --no-cache-dir . "./server[postgres]"
# Not root: a process that escapes the sandbox lands as this user, with no
# capabilities. Its home is FARM_HOME, so what a worker keeps between
# builds (code packs, code envs, the compile cache directory, the compiler
# check's ~/.cache) lives in the one volume docker-compose.yml mounts there.
# The sandbox maps this uid to FARM_SANDBOX_UID inside a user namespace.
RUN groupadd --system --gid 10001 farm \
 && useradd --system --uid 10001 --gid farm --home-dir /var/lib/farm --create-home \
      --shell /usr/sbin/nologin farm
ENV FARM_HOME=/var/lib/farm HOME=/var/lib/farm
USER 10001:10001
ENTRYPOINT ["farm"]
