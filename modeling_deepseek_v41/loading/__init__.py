"""Loading and parallelism: checkpoint checks, what from_pretrained adds to transformers' loader, device maps,
tensor parallelism, Engram tables off the device, parameter counts."""
