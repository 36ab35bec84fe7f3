"""The README's curl examples of the gateway run as written against a real gateway and
worker (only the address and the model name are the test's own)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fleet_fixtures import MODEL

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "### The OpenAI-compatible gateway"


def curl_commands() -> list[str]:
    """Each curl command of the README's gateway section, continuation lines joined."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index(SECTION):]
    section = section[:section.find("\n## ", 1) if "\n## " in section else None]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        joined = block.replace("\\\n", " ")
        commands += [line.split("  #")[0].strip() for line in joined.splitlines()
                     if line.strip().startswith("curl ")]
    return commands


def test_the_readme_shows_curl_examples_of_each_endpoint():
    commands = curl_commands()
    assert any("/v1/chat/completions" in c for c in commands)
    assert any("/v1/completions" in c and '"stream": true' in c for c in commands)
    assert any("/v1/models" in c for c in commands)


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_the_readme_curl_examples_work(start_worker, gateway):
    start_worker()
    for command in curl_commands():
        ours = command.replace("http://localhost:8000", gateway.url).replace(
            '"model": "small"', f'"model": "{MODEL}"')
        done = subprocess.run(["bash", "-c", ours], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (command, done.stderr)
        if '"stream": true' in command:
            events = [line[6:] for line in done.stdout.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all("error" not in json.loads(e)
                                                  for e in events[:-1]), done.stdout
        else:
            answer = json.loads(done.stdout)
            assert "error" not in answer, (command, answer)
            if "/v1/models" in command:
                assert [m["id"] for m in answer["data"]] == [MODEL]
            else:
                assert answer["usage"]["completion_tokens"] > 0
