#!/usr/bin/env python3
"""Write tests/durations.json (seconds per test file) from a pytest --junitxml report.

`make test` hands test files to its workers longest first from this table (see
tests/conftest.py); refresh it when files are added or change much:

    .venv/bin/python -m pytest -q -n 3 --dist loadfile --junitxml=/tmp/suite.xml
    python3 scripts/test-durations.py /tmp/suite.xml
"""

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

seconds: collections.Counter = collections.Counter()
for case in ET.parse(sys.argv[1]).iter("testcase"):
    # classname is "tests.test_x" (or "tests.test_x.TestClass"): the file is its second part
    seconds[f"tests/{case.get('classname').split('.')[1]}.py"] += float(case.get("time") or 0)
table = {name: round(s, 1) for name, s in sorted(seconds.items(), key=lambda item: -item[1])}
out = Path(__file__).resolve().parents[1] / "tests" / "durations.json"
out.write_text(json.dumps(table, indent=1) + "\n")
print(f"{out}: {len(table)} files, {sum(table.values()):.0f} s in all")
