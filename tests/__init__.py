"""The test suite, importable as `tests` from the repository root.

`tests.servers` (real loopback servers: redis-server, moto, fake-gcs-server; also the
pytest plugin that provides them as fixtures), `tests.proxy` (a cuttable TCP proxy)
and `tests.helpers` (end-to-end assertions on a run folder) are shared with bench/
(`python -m bench` from the root).
"""
