"""Prints how long each file's doc-test blocks took, so their share of the suite stays visible."""

import sys


def pytest_terminal_summary(terminalreporter):
    module = sys.modules.get("tests.docs.test_doc_commands")
    if module is not None and module.DURATIONS:
        durations = module.DURATIONS
        terminalreporter.section("doc-test blocks")
        for path, (n, seconds) in sorted(durations.items()):
            terminalreporter.write_line(f"{path}: {n} block(s) in {seconds:.1f} s")
        terminalreporter.write_line(f"total {sum(s for _, s in durations.values()):.1f} s")
