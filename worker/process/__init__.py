"""A worker's processes: the supervisor, one child per device (pinned before `import torch`), its plan, state and start clock."""
