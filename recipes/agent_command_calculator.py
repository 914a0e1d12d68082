"""The calculator as an agent that is a program (env.factory: agent-command:python recipes/agent_command_calculator.py).

A plain script written against the synchronous OpenAI client, as agents are written outside any
trainer: `openai.OpenAI()` reads OPENAI_BASE_URL and OPENAI_API_KEY from the environment (asyncgrpo
sets them to this episode's session of the run's gateway), the prompt's row is one line of JSON
on stdin, and the reward is the last line printed on stdout (a number, null, or an object with
"reward"; anything else goes to stderr). The rules and rewards are the calculator environment's
(asyncgrpo.environments.calculator), reused: a turn starting with "=" calls the calculator, any
other turn is the answer. A refusal at the episode's limits (env.max_turns, env.max_tokens) ends
the episode with the reward so far (docs/agents.md).
"""

import json
import sys

import openai

from asyncgrpo.environments.calculator import CalculatorEnv

LIMITS = ("turn_limit", "context_length_exceeded")  # the gateway's refusals at the episode's limits


def main() -> None:
    row = json.loads(sys.stdin.readline())
    client = openai.OpenAI(max_retries=0)
    env = CalculatorEnv()
    env.reset(row)
    prompt = row["prompt"]
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    reward, info = 0.0, {}
    while True:
        try:
            response = client.chat.completions.create(model="policy", messages=messages)
        except openai.BadRequestError as error:
            if error.code not in LIMITS:
                raise
            break
        text = response.choices[0].message.content or ""
        observation, step_reward, done, step_info = env.step(text)
        reward += step_reward
        info |= step_info
        if done:
            break
        messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": observation}]
    print(json.dumps({"reward": reward, **info}))


if __name__ == "__main__":
    main()
