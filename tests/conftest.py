# The multi-process helper doubles as a pytest plugin (the run_distributed
# fixture). An installed shardstate (wheel or editable) registers it through
# its pytest11 entry point before any conftest runs; from a bare source tree
# (PYTHONPATH=python) nothing has, so it is registered here. Either way it is
# registered once: pytest refuses the same module under a second name.


def pytest_configure(config):
    import os

    import shardstate.testing

    # The suite's ranks fork from one server that imported torch once
    # (run_distributed's forkserver): the whole suite ran in 8 min 46 s
    # instead of about 14 min with a fresh interpreter per rank. A test that
    # needs a fresh interpreter says start_method="spawn"; setting the
    # variable to "spawn" runs the suite the old way.
    os.environ.setdefault("SHARDSTATE_TEST_START_METHOD", "forkserver")

    if not config.pluginmanager.is_registered(shardstate.testing):
        config.pluginmanager.register(shardstate.testing, "shardstate.testing")


def _gpu_present() -> tuple[bool, str]:
    """Whether shardstate sees a CUDA device, asked in a child process so
    that this one never initialises the CUDA driver."""
    import subprocess
    import sys

    code = ("import shardstate.cuda as c; s = c.status().cuda; "
            "print(int(s.available)); print(s.reason)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    if out.returncode != 0 or not lines:
        return False, f"CUDA probe failed: {out.stderr.strip()[-300:]}"
    return lines[0] == "1", "\n".join(lines[1:])


def pytest_collection_modifyitems(config, items):
    # Tests marked gpu are skipped where no GPU is present; nothing else is.
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import pytest

    present, reason = _gpu_present()
    if present:
        return
    skip = pytest.mark.skip(reason=f"needs an NVIDIA GPU: {reason}")
    for item in gpu_items:
        item.add_marker(skip)
