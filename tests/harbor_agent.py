"""A Harbor agent stand-in for the tests: does what an installed agent does, from inside the trial's sandbox.

Loaded by real Harbor (``--agent harbor_agent:ChatAgent``, this folder on ``PYTHONPATH``).
Like Harbor's installed agents (claude-code, codex, ...), it runs its client inside the
environment, which reaches the model only at the base URL Harbor gives it (``--base-url``,
here the path-restricted proxy in front of the gateway): two chat turns, the instruction
then "Go on.", and it writes the model's last reply to ``/app/out.txt`` for the task's
verifier to grade. A real agent would parse commands out of the reply; the tiny test model
writes noise, so this one only carries text, which is all the recording path needs.
"""

import json
import os
import shlex

from harbor.agents.agent_auth_resolution import ModelConnectionSpec, ProviderAccess
from harbor.agents.base import BaseAgent
from harbor.agents.capabilities import AgentCapabilities
from harbor.models.model_api_format import ModelApiFormat

CLIENT = r"""
import json, sys, urllib.request
base, model, instruction = sys.argv[1], sys.argv[2], sys.argv[3]
messages = [{"role": "user", "content": instruction}]
for turn in range(2):
    request = urllib.request.Request(base + "/chat/completions", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": model, "messages": messages, "max_tokens": 6}).encode())
    with urllib.request.urlopen(request, timeout=120) as response:
        reply = json.loads(response.read())["choices"][0]["message"]
    messages += [reply, {"role": "user", "content": "Go on."}]
open("/app/out.txt", "w").write(reply["content"])
print(json.dumps(messages))
"""


PROBE = r"""
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
try:
    socket.create_connection((host, port), timeout=5).close()
    result = "connected"
except OSError as error:
    result = type(error).__name__
open("/logs/agent/probe.txt", "w").write(f"{host}:{port} {result}\n")
"""


class ChatAgent(BaseAgent):
    capabilities = AgentCapabilities(base_url=True)  # Harbor refuses --base-url for an agent without it
    MODEL_CONNECTION = ModelConnectionSpec(  # an OpenAI chat client, as codex's spec declares its own
        default_provider="openai",
        agent_provider_access=ProviderAccess(api_key_candidate_names=["OPENAI_API_KEY"],
                                             base_url_candidate_names=["OPENAI_BASE_URL"]),
        api_key_destination_names={"default": "OPENAI_API_KEY"},
        base_url_destination_names={"default": "OPENAI_BASE_URL"},
        supported_api_formats=[ModelApiFormat.OPENAI_CHAT_COMPLETIONS],
        default_api_format_by_provider={"default": ModelApiFormat.OPENAI_CHAT_COMPLETIONS},
    )

    @staticmethod
    def name() -> str:
        return "dew-chat-standin"

    def version(self) -> str:
        return "1"

    async def setup(self, environment) -> None:
        pass

    async def run(self, instruction, environment, context) -> None:
        model = (self.model_name or "").removeprefix("openai/")
        result = await environment.exec(
            f"python3 -c {shlex.quote(CLIENT)} {shlex.quote(self._base_url)} {shlex.quote(model)} "
            f"{shlex.quote(instruction)}", timeout_sec=300)
        if result.return_code != 0:
            raise RuntimeError(f"the chat client failed ({result.return_code}): {(result.stderr or '')[-500:]}")
        context.metadata = {"messages": json.loads(result.stdout)}


class ProbingChatAgent(ChatAgent):
    """ChatAgent that first tries, from inside the environment, to open a connection to ``DEW_PROBE`` ("host:port",
    from Harbor's environment), an address outside the agent phase's allowlist, and writes what happened to
    ``/logs/agent/probe.txt`` (``<host>:<port> connected`` or the error's type)."""

    @staticmethod
    def name() -> str:
        return "dew-probing-chat-standin"

    async def run(self, instruction, environment, context) -> None:
        host, port = os.environ["DEW_PROBE"].rsplit(":", 1)
        await environment.exec(f"python3 -c {shlex.quote(PROBE)} {shlex.quote(host)} {port}", timeout_sec=60)
        await super().run(instruction, environment, context)
