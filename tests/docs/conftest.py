"""The ``docs`` marker of tests/docs (the guides' command blocks run by test_docs.py)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "docs: runs the command blocks of the docs and README (tests/docs)")
