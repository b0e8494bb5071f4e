"""The model's layers (nn.Modules with the hub checkpoint's names): the stored-format linears and RMSNorm, attention
(CSA2, compressor, indexer), MoE, Engram, hyper-connections, rotary embedding, blocks, the vision tower and the
DSpark drafter's modules."""
