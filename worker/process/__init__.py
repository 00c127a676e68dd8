"""A worker's processes: the supervisor, one child per device (pinned before `import torch`), qualify's child. The top of the worker's packages: it composes the others."""
