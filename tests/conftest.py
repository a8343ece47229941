# The multi-process helper doubles as a pytest plugin (the run_distributed
# fixture). Installed copies register it through the pytest11 entry point;
# here the package is used from the source tree, so load it by name.
pytest_plugins = ["shardstate.testing"]
