# kvcache-exporter: the sidecar, and (`simulate`) the vLLM stand-in of the demo stack.
# Two stages: `build` installs the package into a virtual environment; the runtime stage copies
# only that environment, so it holds no build tools, test or dashboard dependencies. Runs as a
# non-root user and writes nothing at runtime, so `read_only: true` / readOnlyRootFilesystem work
# without extra volumes. Any Debian-like base with python3 (and python3-venv) serves:
#   podman build --format docker --build-arg BASE_IMAGE=localhost/kvcache-base:bookworm .
ARG BASE_IMAGE=python:3.11.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY exporter ./exporter
RUN python3 -m venv /opt/kvcache \
 && /opt/kvcache/bin/pip install --quiet --constraint constraints.txt . \
 && /opt/kvcache/bin/pip uninstall --quiet --yes pip setuptools

FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/kvcache/bin:$PATH
COPY --from=build /opt/kvcache /opt/kvcache
RUN groupadd --gid 10001 kvcache \
 && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvcache

USER 10001:10001
EXPOSE 18090
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:18090/healthz', timeout=4)"]
ENTRYPOINT ["kvcache-exporter"]
CMD ["serve"]
