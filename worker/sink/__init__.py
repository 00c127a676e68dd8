"""The sink: encode and store a batch while the next generates, in a torch-free helper process."""
