"""Command groups beyond the core ones in diffq/cli.py; each module has `register(app)`."""
