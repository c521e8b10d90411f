# kvcache-exporter: the sidecar, and (`simulate`) the vLLM stand-in of the demo stack.
# Runs as a non-root user and writes nothing at runtime, so `read_only: true` /
# readOnlyRootFilesystem work without extra volumes.
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY exporter ./exporter
RUN pip install --constraint constraints.txt . \
 && rm -rf /src \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kvcache

WORKDIR /
USER 10001:10001
EXPOSE 18090
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:18090/healthz', timeout=4)"]
ENTRYPOINT ["kvcache-exporter"]
CMD ["serve"]
