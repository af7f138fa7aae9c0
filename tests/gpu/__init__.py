"""A package, so that its conftest.py does not displace tests/conftest.py, which tests import as ``conftest``."""
