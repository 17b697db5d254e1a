#!/usr/bin/env python3
"""The environment of the agentic "Mom asks" task (aligner's JSON Lines environment protocol).

A persistent process. Each line on stdin is one model turn:
    {"episode", "turn", "prompt", "response", "metadata"}
and each line it writes answers one episode (in any order, matched by "episode"):
    {"episode", "observation", "reward", "done"}

After each of the model's first two turns Mom asks about a thing ("Mom said, "Tell me about
the ball."") and the model's next turn earns 1 when it talks about that thing. The thing asked
for depends on the prompt and the turn only, so the process keeps no state: episodes of many
batches can be in flight at once. Three model turns, at most 2 reward.
"""
import hashlib
import json
import re
import sys

THINGS = ["ball", "cat", "dog", "tree", "park", "cake", "bird", "box", "toy", "car", "sun", "fish"]
TURNS = 3


def thing(prompt, turn):
    digest = hashlib.sha256(f"{prompt}\n{turn}".encode()).digest()
    return THINGS[digest[0] % len(THINGS)]


for line in sys.stdin:
    t = json.loads(line)
    turn = t["turn"]
    reward = 0.0
    if turn > 0:
        asked = thing(t["prompt"], turn - 1)
        if re.search(r"\b" + asked + r"s?\b", t["response"], re.IGNORECASE):
            reward = 1.0
    reply = {"episode": t["episode"], "reward": reward, "done": turn + 1 >= TURNS}
    if turn + 1 < TURNS:
        reply["observation"] = f' Mom said, "Tell me about the {thing(t["prompt"], turn)}."'
    print(json.dumps(reply), flush=True)
