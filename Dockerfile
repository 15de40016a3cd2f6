# One image for api and workers. TORCH_INDEX picks the torch build: CPU by default,
# e.g. --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 for GPU workers.
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /app
# Workers run every job's ranks in a bubblewrap sandbox (docs/security.md), switching to nobody with
# setpriv (util-linux; its own package on newer Debian).
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap \
    && (command -v setpriv >/dev/null || apt-get install -y --no-install-recommends setpriv) \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY api_schemas api_schemas
COPY rank_contract rank_contract
COPY service service
COPY workers workers
COPY migrations migrations
COPY dptrain dptrain
COPY dptrain_cli dptrain_cli
COPY dptrain_server dptrain_server
# [all]: the same image runs the API and the workers (a bare `.` would be the client alone).
RUN pip install --no-cache-dir --extra-index-url "$TORCH_INDEX" '.[all]'
ENV DPTRAIN_ARTIFACT_ROOT=/artifacts
ENTRYPOINT ["dptrain"]
