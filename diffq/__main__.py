"""`python -m diffq …` is the `diffq` command."""

from diffq.app.cli import app

app()
