"""What the test suite and bench/ share (`servers.py`: real loopback servers). No
runtime layer imports it (tests/test_layers.py); it imports nothing of diffq."""
