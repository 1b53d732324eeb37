"""The counting tool of the episode chaos run: a SubprocessEnvironment worker (dew.sandbox.subprocess_environment's protocol).

Reset: the context is two ids chosen by the task, [20 + task % 5, 21]. Each step appends the
model's tokens and the tool's reply id (22 + the step's number); the episode completes after
``TURNS`` model calls. Ids stay inside the chaos run's 32-id vocabulary.
"""

import json
import sys

TURNS = 2

turns = 0
for line in sys.stdin:
    request = json.loads(line)
    if request["op"] == "reset":
        turns = 0
        reply = {"context": [20 + int(request["episode"]["task"]) % 5, 21], "status": "running"}
    elif request["op"] == "step":
        turns += 1
        reply = {"context": request["context"] + request["tokens"] + [22 + turns],
                 "status": "completed" if turns >= TURNS else "running"}
    else:
        reply = {"context": [], "status": "error", "detail": f"the counting tool has no op {request['op']!r}"}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
