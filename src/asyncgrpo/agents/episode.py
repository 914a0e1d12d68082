"""One agent episode: a gateway session, the agent run against it, and the training sample built from it.

Job (`AgentEpisodes.play`): open a session (gateway.py), run `agent(client, row)` as a task of its
own with an `openai.AsyncOpenAI` at the session's base URL (or, for `agent-command:`, the program
as a process given the session's base URL and key: command.py, in a task of its own alike), answer the session's calls in order
(each generated through the collector's retry policy, in this episode's task, every one carrying the session's
`affinity`, so a backend with several servers answers them on one), and when the agent returns build the `Completion`
from the session's conversation (session.py): the prompt of its first request, the model's ids as sampled, the agent's
additions masked out of the loss; a session split where its agent rewrote its history (`env.agent_history: split`) gives
one sample per part, the earlier ones as the completion's `segments`, all under the episode's one reward.

Endings (counters are the collector's; the first of each is logged in full, naming the agent):
- the agent returns a number, None, or a dict whose "reward" is one (its other keys are the
  episode's info): the episode's environment reward, weighted by `env.reward_weight` beside the
  reward functions, which get the session's messages (assistant turns as the agent saw them);
- a refused request (malformed, a limit, a call after the close; wire.py) is answered with an HTTP
  error the client raises, counted in `agent/refused/<reason>`; the agent may go on or end;
- the agent raises (`agent/failed/raised`), returns without calling the model
  (`agent/failed/no_model_call`) or returns anything else (`agent/failed/bad_return`), or neither
  calls the model nor returns within `env.step_timeout_s` (`agent/failed/timeout`): the rollout
  fails (an `EpisodeError`, also counted in `env/errors_total`); `TransientEnvironmentError` is retried
  as an episode's is.
- a program's own failures (command.py: not found, a non-zero exit, no reward, output that is not
  JSON) fail the rollout the same way, counted in `agent/failed/<kind>`;
- cancelled (the group is stale, the run stops): the session closes (the call in flight and every
  later one refused with HTTP 410), the agent's task is cancelled and awaited up to
  `env.cancel_grace_s`; an agent still running then is abandoned, counted in `env/abandoned_total`
  (it is kept referenced until it ends, and its client is closed under it). A program's task ends
  within the grace plus the reap: its process group is killed after the grace (`agent/killed_total`).
- the gateway's server stop outliving its deadline (`env.cancel_grace_s`) is counted in
  `agent/release_timeout_total`; the episode's ending stands.

Invariants: the agent's task never outlives `play` unaccounted (ended, or abandoned and counted);
the session is released on every ending; every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Mapping, MutableMapping
from dataclasses import replace
from typing import Any

from asyncgrpo.agents.command import AgentProcessError, run_command
from asyncgrpo.agents.gateway import NOT_JSON, Call, Gateway, Inbox
from asyncgrpo.agents.session import Limits, Session
from asyncgrpo.agents.wire import Refused, chat_request, chat_response, text_request, text_response
from asyncgrpo.config import EnvConfig, GenerationConfig
from asyncgrpo.environments.agent_spec import AgentCommand, load_agent
from asyncgrpo.environments.conversation import Codec, as_row, transcript
from asyncgrpo.environments.protocol import TransientEnvironmentError
from asyncgrpo.errors import EpisodeError
from asyncgrpo.threads import run_in_daemon_thread
from asyncgrpo.types import Completion, Episode, GenerationRequest, Prompt
from asyncgrpo.worker_process import REAP_TIMEOUT_S

# A turn's generation under the collector's retry policy: (request, the oldest version of the episode's model tokens so far).
Generate = Callable[[GenerationRequest, int | None], Awaitable[Completion]]
Report = Callable[[str, str, str], None]  # (counter, what happened, fix): count it, log the first of its kind


class AgentEpisodes:
    """Plays the agent episodes of one episode runner (see the module docstring)."""

    def __init__(self, env: EnvConfig, generation: GenerationConfig, codec: Codec, counters: MutableMapping[str, int], *,
                 prompt_key: str, max_prompt_tokens: int, report: Report) -> None:
        self.env = env
        self.generation = generation
        self.codec = codec
        self.counters = counters
        self.prompt_key = prompt_key
        self.max_prompt_tokens = max_prompt_tokens
        self.agent = load_agent(env.factory)
        # The openai client's HTTP library (httpx, or httpx2 in openai 3.x) logs every request at INFO: thousands of lines per
        # step on the run's console.
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self.gateway = Gateway()
        self._report = report
        self._abandoned: set[asyncio.Task[Any]] = set()  # stubborn agents, referenced until they end

    async def play(self, prompt: Prompt, request: GenerationRequest, generate: Generate, on_progress: Callable[[], None]) -> Completion:
        inbox = await self.gateway.open()
        session = Session(self.codec, Limits(self.env.max_turns, self.env.max_tokens, self.max_prompt_tokens,
                                             request.sampling.max_new_tokens), self.env.factory, request.request_id,
                          split=self.env.agent_history == "split")
        client, work = self._launch(inbox, as_row(prompt, self.prompt_key), prompt)
        task = asyncio.get_running_loop().create_task(work, name=f"agent-{prompt.id}")
        task.add_done_callback(lambda _: inbox.calls.put_nowait(Call("done", None)))
        try:
            dispatch = await self._serve(inbox, session, request, generate, on_progress, prompt)
            return await self._ending(task, session, dispatch, prompt)
        finally:
            inbox.close()
            try:
                await self._stop(task, prompt)
            finally:
                for _ in range(inbox.after_close):
                    self._refused(Refused("after_close", "a call after its session closed"), prompt)
                try:
                    if not await self.gateway.release(inbox, self.env.cancel_grace_s):
                        self._report("agent/release_timeout_total", f"the gateway did not stop its server within env.cancel_grace_s = "
                                     f"{self.env.cancel_grace_s:g} s after the last session (prompt {prompt.id}) ended; it was "
                                     "forgotten (the next session starts a fresh one)", "Fix: none needed; raise env.cancel_grace_s if it recurs.")
                finally:
                    if client is not None:
                        await client.close()  # an abandoned agent's calls fail from here on

    def _launch(self, inbox: Inbox, row: Mapping[str, Any], prompt: Prompt) -> tuple[Any, Coroutine[Any, Any, Any]]:
        """The agent's client (None for a command, which makes its own) and the work of its episode."""
        if isinstance(self.agent, AgentCommand):
            return None, run_command(self.agent, inbox.base_url, inbox.key, row, grace_s=self.env.cancel_grace_s,
                                     on_killed=lambda what: self._report(
                                         "agent/killed_total", f"the agent process of prompt {prompt.id} {what}",
                                         "Fix: let the agent exit on SIGTERM (its default), or lower what it does before exiting."))
        import openai  # the agents extra; imported by the runs that play agents only

        client = openai.AsyncOpenAI(base_url=inbox.base_url, api_key=inbox.key, max_retries=0,
                                    timeout=self.generation.rollout_deadline_s + self.env.step_timeout_s)
        return client, self.agent(client, row)

    async def _serve(self, inbox: Inbox, session: Session, request: GenerationRequest, generate: Generate,
                     on_progress: Callable[[], None], prompt: Prompt) -> int | None:
        """Answer the session's calls until the agent ends; the version at the first dispatch (None: no model call)."""
        dispatch: int | None = None
        while True:
            try:
                async with asyncio.timeout(self.env.step_timeout_s):
                    call = await inbox.calls.get()
            except TimeoutError:
                raise self._failed(
                    "timeout", prompt, f"neither called the model nor returned within env.step_timeout_s = {self.env.step_timeout_s:g} s",
                    "make the agent's work between model calls shorter, or raise env.step_timeout_s") from None
            if call.kind == "done":
                return dispatch
            try:
                completion = await self._answer(call, session, request, generate, prompt)
            except BaseException:
                call.refuse(Refused("after_close", "the episode ended while this request was being generated (its group went stale, "
                                    "the run stopped, or the generation failed)."))
                raise
            if completion is not None and dispatch is None:
                dispatch = completion.dispatch_version
            on_progress()

    async def _answer(self, call: Call, session: Session, request: GenerationRequest, generate: Generate, prompt: Prompt) -> Completion | None:
        try:
            if call.body is NOT_JSON:
                raise Refused("malformed", "the request body is not JSON. Fix: send the OpenAI request object as JSON.")
            samples = len(session.samples())
            if call.kind == "chat":
                chat = chat_request(call.body)
                ids, budget = await self._encoding(lambda: session.plan_chat(chat))
                model = chat.model
            else:
                text = text_request(call.body)
                ids, budget = await self._encoding(lambda: session.plan_text(text))
                model = text.model
        except Refused as refusal:
            self._refused(refusal, prompt)
            call.refuse(refusal)
            return None
        if samples and len(session.samples()) > samples:
            self._report("agent/split_samples_total", f"the agent's request after turn {session.turns} (prompt {prompt.id}) does not "
                         f"extend its conversation; it started sample {len(session.samples())} of the episode (env.agent_history: split)",
                         "none needed: each sample is trained with the episode's advantage (docs/agents.md)")
        versions = [v for sample in session.samples() for v in sample.model_versions()]  # every sample's: all are trained
        turn_request = replace(request, request_id=f"{request.request_id}-t{session.turns}", prompt_token_ids=ids,
                               sampling=replace(request.sampling, max_new_tokens=budget), seed=request.seed + session.turns,
                               affinity=session.affinity)
        completion = await generate(turn_request, min(versions) if versions else None)
        unparsed = session.unparsed_tool_calls
        turn = session.add_turn(completion)
        if session.unparsed_tool_calls > unparsed:
            self._report("agent/unparsed_tool_calls_total", f"the model's turn {session.turns} (prompt {prompt.id}) has a <tool_call> that is "
                         "not a JSON call; it was returned as text", "none needed: the model learns the format, or the agent reads the text")
        ident = f"{call.kind}cmpl-{request.request_id}-{session.turns}"
        call.answer.set_result(chat_response(ident, model, turn, completion, len(ids)) if call.kind == "chat"
                               else text_response(ident, model, completion, len(ids)))
        return completion

    async def _ending(self, task: asyncio.Task[Any], session: Session, dispatch: int | None, prompt: Prompt) -> Completion:
        """The episode's sample from the agent's return, or the error its ending is."""
        if task.cancelled():
            raise self._failed("raised", prompt, "cancelled itself (its task ended cancelled)", "let the agent return a reward")
        error = task.exception()
        if isinstance(error, AgentProcessError):
            raise self._failed(error.kind, prompt, error.what, error.fix)
        if error is not None:
            transient = isinstance(error, TransientEnvironmentError)
            raise self._failed("raised", prompt, f"raised {type(error).__name__}: {error}",
                               "the agent's traceback is chained to this error (asyncgrpo --debug shows it); raise TransientEnvironmentError "
                               "for failures worth retrying", transient=transient) from error
        value = task.result()
        conv = session.conversation
        if dispatch is None or conv is None:
            raise self._failed("no_model_call", prompt, f"returned {value!r} without a model call answered",
                               "call client.chat.completions.create (or completions.create) before returning")
        reward, info = self._reward(value, prompt)
        await self._encoding(conv.check_final_drift)  # an earlier sample's was checked when it ended (session.py)
        samples = session.samples()
        versions = [v for sample in samples for v in sample.model_versions()]
        messages = tuple(session.episode_messages())
        stop = session.limit_hit or "done"
        episode = Episode(messages=messages, turns=session.turns, stop_reason=stop, env_reward=reward,  # type: ignore[arg-type]
                          version_span=(min(versions, default=dispatch), max(versions, default=dispatch)),
                          drift_turns=sum(sample.drift_turns for sample in samples), info=(info,), step_rewards=(reward,))
        # A split episode's earlier samples (env.agent_history: split): each ended with a model turn the agent went on from.
        segments = tuple(Completion(token_ids=tuple(s.ids), logprobs=tuple(s.logprobs), versions=tuple(s.versions), finish_reason="stop",
                                    dispatch_version=min(s.model_versions(), default=dispatch), loss_mask=tuple(s.mask),
                                    prompt_token_ids=s.prompt_ids) for s in samples[:-1])
        return Completion(token_ids=tuple(conv.ids), logprobs=tuple(conv.logprobs), versions=tuple(conv.versions),
                          finish_reason="length" if stop == "max_tokens" else "stop", dispatch_version=dispatch, text=transcript(messages),
                          loss_mask=tuple(conv.mask), episode=episode, prompt_token_ids=conv.prompt_ids, segments=segments)

    def _reward(self, value: Any, prompt: Prompt) -> tuple[float | None, dict[str, Any]]:
        info: dict[str, Any] = {}
        reward = value
        if isinstance(value, dict) and "reward" in value:
            info = {k: v for k, v in value.items() if k != "reward"}
            reward = value["reward"]
        if reward is None or (isinstance(reward, int | float) and not isinstance(reward, bool) and math.isfinite(reward)):
            return (None if reward is None else float(reward)), info
        raise self._failed("bad_return", prompt, f"returned {value!r}",
                           "return a finite number, None (no reward from the agent), or a dict whose 'reward' is one")

    def _failed(self, kind: str, prompt: Prompt, what: str, fix: str, *, transient: bool = False) -> EpisodeError:
        self.counters["env/errors_total"] += 1
        self._report(f"agent/failed/{kind}", f"the agent {what} (prompt {prompt.id}); the rollout failed", f"Fix: {fix}.")
        return EpisodeError(f"agent {self.env.factory!r} {what} (prompt {prompt.id}). Fix: {fix}.", backend=self.env.factory, transient=transient)

    def _refused(self, refusal: Refused, prompt: Prompt) -> None:
        self._report(f"agent/refused/{refusal.reason}", f"a request of the agent's session (prompt {prompt.id}) was refused with HTTP "
                     f"{refusal.status}: {refusal}", "The agent's client raised it (openai.APIStatusError); the agent may go on or end.")

    async def _stop(self, task: asyncio.Task[Any], prompt: Prompt) -> None:
        """Cancel the agent's task and wait for it up to env.cancel_grace_s; one still running then is abandoned and counted."""
        if task.done():
            return
        task.cancel()
        # A command agent's process is killed after the grace and then reaped (bounded): it ends within both.
        wait_s = self.env.cancel_grace_s + (REAP_TIMEOUT_S if isinstance(self.agent, AgentCommand) else 0.0)
        try:
            done, _ = await asyncio.wait({task}, timeout=wait_s)
        except asyncio.CancelledError:
            self._abandon(task, prompt, "was cancelled again while it was being stopped")
            raise
        if not done:
            self._abandon(task, prompt, f"was still running {wait_s:g} s after its cancellation (env.cancel_grace_s = {self.env.cancel_grace_s:g})")

    def _abandon(self, task: asyncio.Task[Any], prompt: Prompt, what: str) -> None:
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned.discard)
        self._report("env/abandoned_total", f"the agent of prompt {prompt.id} {what}; it is abandoned (its session refuses its calls)",
                     "Fix: let CancelledError end the agent (do not catch it, or re-raise it), and return when a call raises.")

    async def _encoding(self, work: Callable[[], Any]) -> Any:
        """Tokenizer work of the session: on a thread of its own when the codec asks (the loop never waits for it)."""
        return await run_in_daemon_thread(work, name="asyncgrpo-agent-encode") if self.codec.offload else work()
