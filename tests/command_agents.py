"""Command agents for the gateway's tests: `env.factory: agent-command:<python> tests/command_agents.py <mode> <dir>`.

Standard library only (urllib; a process each episode, so they start fast). Each records itself in `<dir>` as a file named
by its process group's id holding its question, then starts `sleep 600` in its process group (what it leaves
behind must die with it). Modes:
- two_turns: two model calls with a user message between them; prints {"reward": 1.0, "turns": 2};
- no_reward: one model call, prints nothing; garbage: one model call, prints "done!";
- stubborn: ignores SIGTERM (its sleep too) and, after a call fails, sleeps instead of exiting; else as two_turns;
- waits: calls nothing, waits (until killed).
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request


def chat(messages: list) -> str:
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps({"model": "policy", "messages": messages}).encode(),
        headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)["choices"][0]["message"]["content"]


def main(mode: str, record: str) -> None:
    row = json.loads(sys.stdin.readline())
    question = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen(["sleep", "600"])
    with open(os.path.join(record, str(os.getpgrp())), "w") as file:
        file.write(question)
    if mode == "waits":
        signal.pause()
    messages = [{"role": "user", "content": question}]
    try:
        first = chat(messages)
        if mode == "no_reward":
            return
        if mode == "garbage":
            print("done!")
            return
        chat([*messages, {"role": "assistant", "content": first}, {"role": "user", "content": "again"}])
    except Exception:
        if mode == "stubborn":
            time.sleep(600)
        raise
    print("a log line before the reward")
    print(json.dumps({"reward": 1.0, "turns": 2}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
