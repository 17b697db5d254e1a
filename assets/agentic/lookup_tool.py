#!/usr/bin/env python3
"""The `lookup` tool of the agentic lookup task (aligner's tool protocol).

One call per run: reads {"name", "arguments", "metadata"} as one JSON line on stdin and prints
the result on stdout. The secret word is the prompt row's `word` (metadata): the story's
opening does not show it, so the model learns it only by calling this tool.
"""
import json
import sys

call = json.loads(sys.stdin.readline())
word = call.get("metadata", {}).get("word")
if not word:
    sys.stderr.write("the prompt row has no `word`\n")
    sys.exit(1)
print(word)
