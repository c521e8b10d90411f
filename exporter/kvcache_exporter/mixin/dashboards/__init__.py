"""Grafana dashboards as code (grafana-foundation-sdk, the `dashboards` extra): render.py writes them."""
