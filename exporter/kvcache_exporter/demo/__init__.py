"""`kvcache-exporter demo`: simulator + exporter (+ Prometheus/Alertmanager when installed), live view."""
