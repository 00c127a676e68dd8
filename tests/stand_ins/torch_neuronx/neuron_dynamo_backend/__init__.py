"""The stand-in's torch.compile backend module (the real one: torch-neuronx neuron_dynamo_backend/)."""
