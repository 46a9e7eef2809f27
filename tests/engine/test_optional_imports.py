"""Optional packages are imported only by the paths that need them: llguidance by constrained requests, gguf
by GGUF conversion. Without them an engine starts and serves unconstrained requests, and a constrained one
is refused with an error naming llguidance."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import sys

    class Blocker:
        BLOCKED = ("llguidance", "gguf")

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.BLOCKED:
                raise ImportError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, Blocker())
    for name in list(sys.modules):
        assert name.split(".")[0] not in Blocker.BLOCKED, name

    from tritium.backend import LLM, SamplingParams

    llm = LLM(sys.argv[1], kv_cache_bytes=16 << 20)
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4, out
    try:
        llm.generate("Once", SamplingParams(max_tokens=4, structured_output={"regex": "[a-z]+"}))
    except Exception as exc:
        print("REFUSED:", type(exc).__name__, exc)
    else:
        raise SystemExit("a constrained request ran without llguidance")
    out = llm.generate("still serving", SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 2, out
    loaded = sorted(n for n in sys.modules if n.split(".")[0] in Blocker.BLOCKED)
    assert not loaded, loaded
    print("OK")
    """
)


def test_an_engine_serves_without_llguidance_and_gguf(tiny_llama_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama_path)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    refused = next(line for line in proc.stdout.splitlines() if line.startswith("REFUSED:"))
    assert "llguidance" in refused, refused
    assert "OK" in proc.stdout.splitlines()
