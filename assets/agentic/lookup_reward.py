#!/usr/bin/env python3
"""Reward command of the agentic lookup task (aligner's `reward.command` protocol).

Reads one JSON request per line ({"prompt", "response", "metadata": {"word"}, ...}; the
response is the whole episode: the model's turns and the tool's observations) and writes one
score per line: 0.25 for calling the tool (the observation "The secret word was <word>." is in
the episode), plus 1.0 when the model then uses that word in its own text after it. Never
calling the tool scores 0, whatever the story says.
"""
import json
import re
import sys

MARKER = re.compile(r"The secret word was (\w+)\.")

for line in sys.stdin:
    request = json.loads(line)
    word = request["metadata"]["word"]
    text = request["response"]
    found = MARKER.search(text)
    score = 0.0
    if found:
        score = 0.25
        after = MARKER.sub(" ", text[found.start():])
        if re.search(r"\b" + re.escape(word) + r"\b", after, re.IGNORECASE):
            score += 1.0
    print(json.dumps({"score": score}), flush=True)
