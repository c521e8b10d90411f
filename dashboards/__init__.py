"""Grafana dashboards as code: `python -m dashboards` writes dashboards/json/*.json."""
