# syntax=docker/dockerfile:1
# kvstore's images. Two targets:
#
#   docker build -t kvstore:cpu .                                   # everything: workers, engines, CLI (CPU)
#   docker build --build-arg VARIANT=cuda -t kvstore:cuda .         # the same on CUDA (GPU)
#   docker build --target directory -t kvstore-directory .          # the directory alone: no torch, no NIXL
#
# Dependencies come from constraints.txt (the versions `make test` ran with) and are installed
# before the kvstore wheel, from pyproject.toml alone (scripts/requirements.py), so a change to the
# code rebuilds only the last layers.
#
# VARIANT=cuda: an nvidia/cuda runtime base (the CUDA 12 libraries, libcufile among them), the CUDA
# build of torch (TORCH_INDEX), and the same nixl-cu12 wheel, whose GDS_MT backend (HBM <-> NVMe
# through cuFile) loads only there. Run it with `--gpus all` (Kubernetes: an nvidia.com/gpu limit). GDS also needs
# the host's nvidia-fs kernel driver (and its /dev/nvidia-fs* devices in the container); without it
# a worker started with `--gds auto` goes on without GDS, one started with `--gds on` refuses.
# The CUDA variant has not been built or run yet.
ARG VARIANT=cpu

# --- the wheel (pure Python) ---
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvstore ./kvstore
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --- the directory: FastAPI, SQLAlchemy, psycopg; no torch, no NIXL ---
FROM python:3.11-slim AS directory
COPY pyproject.toml constraints.txt scripts/requirements.py /deps/
RUN python /deps/requirements.py directory > /deps/directory.txt \
    && pip install --no-cache-dir -c /deps/constraints.txt -r /deps/directory.txt
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/kvstore-*.whl && rm -rf /wheels \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /var/lib/kvstore --shell /usr/sbin/nologin kvstore \
    && install -d -o kvstore -g kvstore -m 0700 /var/lib/kvstore /run/kvstore
USER 10001:10001
WORKDIR /var/lib/kvstore
EXPOSE 8700
ENTRYPOINT ["kvstore"]
CMD ["directory", "serve", "--help"]

# --- CPU base: torch first from the CPU index (a bare torch requirement pulls the CUDA build) ---
FROM python:3.11-slim AS base-cpu
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

# --- GPU base: Ubuntu's python3 (3.12) in a venv, the CUDA build of torch ---
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS base-cuda
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" torch==2.13.0

# --- runtime ---
# --- everything (the default target): workers, engines, the directory, the CLI ---
# hadolint ignore=DL3006
FROM base-${VARIANT} AS full
# torch is already satisfied; nixl-cu12 (UCX, POSIX, OBJ and GDS_MT backends, libaio and liburing
# bundled), boto3, FastAPI, psycopg, transformers come from PyPI, at constraints.txt's versions
COPY pyproject.toml constraints.txt scripts/requirements.py /deps/
RUN python /deps/requirements.py all > /deps/all.txt \
    && pip install --no-cache-dir -c /deps/constraints.txt -r /deps/all.txt
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/kvstore-*.whl && rm -rf /wheels
# /run/kvstore: token files; /var/lib/kvstore/nvme: NVMe slab files. Owned by the service user so
# that named volumes mounted there start with the right owner.
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /var/lib/kvstore --shell /usr/sbin/nologin kvstore \
    && install -d -o kvstore -g kvstore -m 0700 /var/lib/kvstore /var/lib/kvstore/nvme /run/kvstore
USER 10001:10001
WORKDIR /var/lib/kvstore
# the directory; workers listen on their --port (8710 in deploy/)
EXPOSE 8700
ENTRYPOINT ["kvstore"]
CMD ["--help"]
