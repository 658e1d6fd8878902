#!/usr/bin/env python3
"""Reads cargo's --message-format=json on stdin; prints "name path" per executable artifact."""
import json
import sys

for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])
