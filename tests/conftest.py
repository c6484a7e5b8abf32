"""Session teardown of the pooled rank processes (tests/dist_utils.py)."""


def pytest_sessionfinish(session, exitstatus):
    import dist_utils

    dist_utils.close_pools()
