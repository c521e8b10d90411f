"""The monitoring mixin: recording rules, alerts, Alertmanager files and Grafana dashboards,
all rendered from one config (config.py; defaults in data/config.yaml). `kvcache-exporter mixin`
writes them; `serve` never imports this package."""
