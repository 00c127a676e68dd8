"""The device: the backend table, models (local, hub, object storage), the pipeline host, compiling, tensor-parallel groups, speed-ups, fault injection."""
