"""Stand-ins for the classes of ``torch.distributed.checkpoint.metadata``, for
CPython's C pickler (``_pickle``'s fast ``.metadata`` writer).

The C pickler names a class by importing its module, so it cannot write
torch's class paths without importing torch's checkpoint package. The fast
writer instead pickles these classes, which pickle exactly as torch's do,
then renames their module in the output. This module's name has exactly the
length of ``torch.distributed.checkpoint.metadata`` (37 characters), so the
rename changes no length and every ``FRAME`` stays valid. Nothing else uses
these classes; instances never leave ``_pickle``.
"""

from enum import Enum


class Metadata:
    pass


class TensorStorageMetadata:
    pass


class BytesStorageMetadata:
    pass


class ChunkStorageMetadata:
    pass


class MetadataIndex:
    pass


class StorageMeta:
    pass


class TensorProperties:
    """Its pickled state is a 5-tuple, as torch's ``__getstate__`` returns."""

    __slots__ = ("state",)

    def __getstate__(self) -> tuple:
        return self.state


class _MEM_FORMAT_ENCODING(Enum):
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2
