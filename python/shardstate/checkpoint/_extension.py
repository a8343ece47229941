"""Checkpoint extensions (torch 2.13's ``torch.distributed.checkpoint._extension``):
stream transforms that each item's bytes go through on the way to storage,
such as ZStandard compression.

With torch installed these are torch's own classes, so an extension written
for torch (a subclass of torch's ``StreamTransformExtension``, registered in
torch's ``ExtensionRegistry``) works with shardstate's ``FileSystemWriter``
and ``FileSystemReader`` as it is, and the other way round. Without torch
(NumPy-only state) the classes below stand in, with the same names, methods
and descriptors (``"stream.zstd/1"``), writing the same bytes.

``ZStandard`` needs the ``zstandard`` package (``pip install zstandard``, or
the ``shardstate[zstd]`` extra); torch's also takes ``pyzstd``. Without it
shardstate works as before, and only making a ``ZStandard``, or reading an
item written with one, raises ``ValueError`` saying what is missing.

How the writer and reader use these (the bytes on disk, the descriptor
order, the bounds on what a transform may produce) is in ``_fs_transform``.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Sequence
from typing import IO, Any

from .._util import torch_dcp

__all__ = [
    "Extension",
    "ExtensionRegistry",
    "StreamTransformExtension",
    "ZStandard",
]

if torch_dcp() is not None:
    from torch.distributed.checkpoint._extension import (
        Extension,
        ExtensionRegistry,
        StreamTransformExtension,
        ZStandard,
    )
else:
    zstandard_module_name = "zstandard"

    def _zstandard() -> Any:
        """The ``zstandard`` module, or None when it is not installed."""
        try:
            return importlib.import_module(zstandard_module_name)
        except ImportError:
            return None

    class Extension(abc.ABC):  # type: ignore[no-redef]
        """A modular addition to checkpointing that changes the layout or
        format of what is written. At write time each extension gives a
        descriptor (``"name[@local-domain][/version]"``), stored with the
        items it applied to, from which ``ExtensionRegistry`` makes it again
        at read time."""

        @staticmethod
        @abc.abstractmethod
        def registry_name() -> str:
            """The name the registry knows this extension's class by."""

        @staticmethod
        @abc.abstractmethod
        def from_descriptor(version: str) -> Extension:
            """An instance for a descriptor's version (the part after "/")."""

        @abc.abstractmethod
        def get_descriptor(self) -> str:
            """The descriptor recorded in the metadata."""

    class StreamTransformExtension(Extension):  # type: ignore[no-redef]
        """An extension that transforms an item's byte stream (compression,
        encryption), ideally in chunks rather than whole or byte by byte."""

        @abc.abstractmethod
        def transform_to(self, output: IO[bytes]) -> IO[bytes]:
            """A writable stream: what is written to it is transformed and
            written to ``output``; closing it closes ``output``."""

        @abc.abstractmethod
        def transform_from(self, input: IO[bytes]) -> IO[bytes]:  # noqa: A002 - torch's name
            """A readable stream: reading it reads ``input`` and returns the
            bytes transformed back."""

    class ZStandard(StreamTransformExtension):  # type: ignore[no-redef]
        """ZStandard compression of each item (``"stream.zstd/1"``), through
        the ``zstandard`` package's streaming compressor at its defaults, as
        torch's does."""

        @staticmethod
        def is_available() -> bool:
            return _zstandard() is not None

        @staticmethod
        def from_descriptor(version: str) -> ZStandard:
            if version.partition(".")[0] != "1":
                raise ValueError(f"Unknown extension {version=}")
            if not ZStandard.is_available():
                raise ValueError(
                    "Stream with ZStandard compression cannot be processed because no module "
                    f"named '{zstandard_module_name}' (pip install zstandard)")
            return ZStandard()

        @staticmethod
        def registry_name() -> str:
            return "stream.zstd"

        def __init__(self) -> None:
            super().__init__()
            if not ZStandard.is_available():
                raise ValueError(
                    "ZStandard extension is unavailable because no module named "
                    f"'{zstandard_module_name}' (pip install zstandard)")

        def get_descriptor(self) -> str:
            return f"{self.registry_name()}/1"

        def transform_to(self, output: IO[bytes]) -> IO[bytes]:
            return _zstandard().ZstdCompressor().stream_writer(output)

        def transform_from(self, input: IO[bytes]) -> IO[bytes]:  # noqa: A002 - torch's name
            return _zstandard().ZstdDecompressor().stream_reader(input)

    class ExtensionRegistry:  # type: ignore[no-redef]
        """Extension classes by registry name; ZStandard is known from the start."""

        def __init__(self) -> None:
            self.extensions: dict[str, type[Extension]] = {
                cls.registry_name(): cls for cls in (ZStandard,)
            }

        def register(self, cls: type[Extension]) -> None:
            self.extensions[cls.registry_name()] = cls

        def from_descriptor_list(self, descriptors: Sequence[str]) -> Sequence[Extension]:
            """An extension for each descriptor: the registry looks up the
            name before the "/" and passes the rest (the version) to the
            class's ``from_descriptor``. An unknown name raises ValueError;
            an error of ``from_descriptor`` passes through."""

            def one(desc: str) -> Extension:
                name, _, version = desc.partition("/")
                ext = self.extensions.get(name)
                if not ext:
                    raise ValueError(f"Unknown extension {name=}")
                return ext.from_descriptor(version)

            return [one(d) for d in descriptors]
