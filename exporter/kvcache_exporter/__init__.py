"""kvcache-exporter: a Prometheus sidecar for vLLM's KV (prefix) cache."""

__version__ = "0.1.0"
