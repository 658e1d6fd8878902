#!/usr/bin/env python3
"""The device run's log (scripts/device/run.sh) as a results JSON: each step's exit status and
time, each test binary's result line, and the lines that report errors against the reference.
Usage: run_log_json.py run.log OUT.json --date D --device NAME --commit C"""
import json
import re
import sys

arg = lambda k: sys.argv[sys.argv.index(k) + 1] if k in sys.argv else None
steps, current, results, checks = [], None, {}, []
for line in open(sys.argv[1]):
    line = line.rstrip("\n")
    m = re.match(r"=== (\S+): rc=(\d+) \((\d+) s\)", line)
    if m:
        steps.append({"step": m.group(1), "rc": int(m.group(2)), "seconds": int(m.group(3))})
        continue
    m = re.match(r"=== (\S+)$", line)
    if m:
        current = m.group(1)
        continue
    if line.startswith("test result:"):
        results.setdefault(current, []).append(line)
    elif "pass ratio" in line or line.startswith("selftest:"):
        checks.append({"step": current, "line": line})
json.dump({"date": arg("--date"), "device": arg("--device"), "commit": arg("--commit"),
           "steps": steps, "test_results": results, "reference_checks": checks,
           "failed_steps": [s["step"] for s in steps if s["rc"] != 0]},
          open(sys.argv[2], "w"), indent=1)
