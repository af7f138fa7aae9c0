"""A package, so that its conftest.py does not displace tests/conftest.py: both would be the module ``conftest``."""
