# syntax=docker/dockerfile:1
# Bulkhead, CUDA build: the same binary built with the `cuda` cargo feature, on NVIDIA's CUDA
# runtime image (CUDA 13; cudarc loads the driver and NVRTC at run time, which compiles the
# kernels: no cuBLAS).
#
#   docker build -f deploy/docker/cuda.Dockerfile -t bulkhead:cuda .     # from the repo root
#
# The Rust toolchain is copied from the official Rust image into NVIDIA's devel image (the
# Debian-built toolchain runs on Ubuntu 24.04's newer glibc): the binary then links against
# the glibc of the runtime image it runs on. No build step needs nvcc. Run the image with the NVIDIA container toolkit (`--gpus all`, or a
# `nvidia.com/gpu` resource on Kubernetes).

FROM rust:1.95-slim-bookworm AS rust

FROM nvidia/cuda:13.0.0-devel-ubuntu24.04 AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential pkg-config ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=rust /usr/local/cargo /usr/local/cargo
COPY --from=rust /usr/local/rustup /usr/local/rustup
ENV CARGO_HOME=/usr/local/cargo RUSTUP_HOME=/usr/local/rustup PATH=/usr/local/cargo/bin:$PATH
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin bulkhead --features cuda \
    && install -m 0755 target/release/bulkhead /usr/local/bin/bulkhead

FROM python:3.12-slim-bookworm AS model
COPY scripts/fetch-model /usr/local/bin/fetch-model
RUN BULKHEAD_MODEL_DIR=/models /usr/local/bin/fetch-model

FROM nvidia/cuda:13.0.0-runtime-ubuntu24.04
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/bulkhead bulkhead \
    && mkdir -p /var/lib/bulkhead /etc/bulkhead/policies \
    && chown bulkhead:bulkhead /var/lib/bulkhead
COPY --from=build /usr/local/bin/bulkhead /usr/local/bin/bulkhead
COPY --from=model /models /models
ENV BULKHEAD_MODEL=/models/SmolLM2-135M-Instruct.Q4_1.gguf \
    BULKHEAD_LOG=info \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /var/lib/bulkhead
EXPOSE 8080 9090 50051 50061 9091
ENTRYPOINT ["/usr/local/bin/bulkhead"]
CMD ["--help"]
