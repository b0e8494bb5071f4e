"""Loading and parallelism: `from_pretrained`'s ordered steps (pipeline.py), the safetensors header reader,
checkpoint checks, device maps, tensor parallelism, Engram tables off the device, parameter counts."""
