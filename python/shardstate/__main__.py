"""``python -m shardstate``: the ``shardstate`` command (``shardstate.cli``)."""

from .cli import _entry

if __name__ == "__main__":
    _entry()
