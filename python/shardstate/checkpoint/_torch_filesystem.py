"""Stand-in for ``torch.distributed.checkpoint.filesystem._StorageInfo``, for
``_pickle``'s fast ``.metadata`` writer. As ``_torch_metadata``: this module's
name has exactly the length of torch's (39 characters), so renaming it in the
pickle keeps every ``FRAME`` length."""


class _StorageInfo:
    pass
