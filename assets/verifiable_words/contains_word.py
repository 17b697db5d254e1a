#!/usr/bin/env python3
"""Reward command of the verifiable_words task (aligner's `reward.command` protocol).

Reads one JSON request per line on stdin:
    {"prompt", "response", "stop_reason", "response_tokens", "metadata": {"word": ...}}
and writes one score per line on stdout: 1.0 when the response contains the row's target
word as a whole word (any case), else 0.0. It stays running for the whole training run.

`--delay-ms N` waits N ms per request before answering, standing in for a verifier that takes
real time (running a program's tests, asking a remote judge): the README's one-step-off
measurement uses it.
"""
import json
import re
import sys
import time

delay = 0.0
if "--delay-ms" in sys.argv:
    delay = float(sys.argv[sys.argv.index("--delay-ms") + 1]) / 1000.0

for line in sys.stdin:
    if delay:
        time.sleep(delay)
    request = json.loads(line)
    word = request["metadata"]["word"]
    found = re.search(r"\b" + re.escape(word) + r"\b", request["response"], re.IGNORECASE)
    print(json.dumps({"score": 1.0 if found else 0.0}), flush=True)
