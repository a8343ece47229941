"""shardstate.fsdp: FSDP optimizer-state handling (torch 2.13 API) on a C core."""
