"""Generated Grafana dashboards (json/); `python -m dashboards` writes them from alerts/config.yaml."""
