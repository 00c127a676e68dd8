"""Observation: JSON log lines and Prometheus metrics per process."""
