# One image for the API and the workers. The GPU worker uses the CUDA build of
# torch (TORCH_INDEX); the default is the CPU build.
# The patch version is pinned: it is part of every target (python=3.11.7), and
# a floating tag would move the workers' target under the artifacts built for it.
ARG PYTHON_VERSION=3.11.7
FROM python:${PYTHON_VERSION}-slim
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
# bubblewrap: the build sandbox (farm.build.sandbox); setpriv comes with util-linux.
RUN apt-get update && apt-get install -y --no-install-recommends g++ curl bubblewrap \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY farm farm
COPY registry registry
COPY workers workers
COPY migrations migrations
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "$TORCH_SPEC" \
 && pip install --no-cache-dir ".[server,postgres]"
ENV FARM_HOME=/var/lib/farm
ENTRYPOINT ["farm"]
