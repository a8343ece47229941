"""torch.distributed.checkpoint drop-in (package marker; the API arrives later)."""
