"""The test suite, importable as `tests` from the repository root.

`tests.servers` (the pytest plugin that provides the real loopback servers of
`diffq.testing.servers` as fixtures: redis-server, moto, fake-gcs-server, RabbitMQ),
`tests.proxy` (a cuttable TCP proxy) and `tests.helpers` (end-to-end assertions on a
run folder). bench/ imports none of it: it shares the servers through `diffq.testing`.
"""
