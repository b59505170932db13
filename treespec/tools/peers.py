"""Peer engines for the benchmark: vLLM's CPU build, run in its own virtual environment.

vLLM pins an older transformers than treespec, so it cannot live in treespec's environment. `make
vllm-env` (scripts/make_vllm_env.sh) creates `.venv-vllm`; `VllmPeer` starts `vllm_worker.py` there as
a subprocess and sends it the same prompt token ids (same chat template) the other methods get.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

DEFAULT_VLLM_PYTHON = Path(".venv-vllm") / "bin" / "python"
WORKER = Path(__file__).with_name("vllm_worker.py")


class PeerUnavailable(RuntimeError):
    """The peer engine cannot be started (the message says how to set it up)."""


def vllm_python(explicit: str | os.PathLike | None = None) -> Path:
    """The vLLM environment's interpreter: `explicit`, $TREESPEC_VLLM_PYTHON, or ./.venv-vllm."""
    path = Path(explicit or os.environ.get("TREESPEC_VLLM_PYTHON") or DEFAULT_VLLM_PYTHON)
    if not path.is_file():
        raise PeerUnavailable(
            f"no vLLM environment at {path}: run `make vllm-env` in the treespec checkout (it creates "
            ".venv-vllm with vLLM's CPU build), or point --vllm-python / TREESPEC_VLLM_PYTHON at one"
        )
    return path


class VllmPeer:
    """One vLLM engine in a subprocess; `run(ids, max_new_tokens)` -> {"token_ids", "seconds"}."""

    def __init__(
        self,
        model_folder: str | os.PathLike,
        dtype: str,
        ngram: int = 0,
        python=None,
        max_len: int = 4096,
        log: str | os.PathLike | None = None,
        kv_cache_gb: int | None = None,
        draft: str | os.PathLike | None = None,
        draft_method: str = "eagle3",
        draft_tokens: int = 3,
    ):
        """kv_cache_gb: vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE; the worker's default is 2 GB);
        draft: a drafter folder `treespec export` wrote, served with vLLM's `draft_method`, drafting
        `draft_tokens` tokens per step."""
        command = [
            str(vllm_python(python)),
            str(WORKER),
            "--model",
            str(model_folder),
            "--dtype",
            dtype,
            "--ngram",
            str(ngram),
            "--max-len",
            str(max_len),
        ]
        if draft:
            command += [
                "--draft",
                str(draft),
                "--draft-method",
                draft_method,
                "--draft-tokens",
                str(draft_tokens),
            ]
        # the worker's stderr always goes to a file, so that a failure can quote it; without `log` a
        # temporary one, removed by close()
        self._own_log = log is None
        self.log_path = (
            Path(log) if log else Path(tempfile.mkstemp(prefix="treespec-vllm-", suffix=".log")[1])
        )
        stderr = open(self.log_path, "w")  # noqa: SIM115
        # vLLM serves with one thread unless OMP_NUM_THREADS says otherwise: give it the threads torch has
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads())),
        }
        if kv_cache_gb:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gb)
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            bufsize=1,
            env=env,
        )
        self.info = self._read() | {"threads": env["OMP_NUM_THREADS"]}
        if not self.info.get("ready"):
            raise PeerUnavailable(f"vLLM worker did not start: {self.info}")

    def engine_name(self, temperature: float = 0.0) -> str:
        """What answers, as data manifests record it: "vllm <version>" (sampling: the worker cannot seed
        each request, so a redone shard would sample other tokens; the name says so)."""
        name = f"vllm {self.info.get('vllm', '?')}"
        return f"{name}, sampling seeded per engine, not per shard" if temperature > 0 else name

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise PeerUnavailable(f"the vLLM worker exited (code {code}){self._log_tail()}")
        return json.loads(line)

    def _ask(self, request: dict) -> dict:
        """One JSON line to the worker, its one-line answer back."""
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def run(self, ids: list[int], max_new_tokens: int) -> dict:
        return self._ask({"ids": list(ids), "max_new_tokens": max_new_tokens})

    def run_batch(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int | None, stop_ids
    ) -> list[list[int]]:
        """Answers to many prompts at once (vLLM batches them itself), each ending with its stop token
        when it hit one; temperature 0 is greedy, else plain sampling (no top-k / top-p). `seed` is not
        passed on: vLLM's CPU build fails on per-request seeds (`engine_name` records it)."""
        request = {
            "batch": [list(p) for p in prompts],
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "seed": seed,
            "stop_token_ids": list(stop_ids),
        }
        return self._ask(request)["batch_token_ids"]

    def spec_metrics(self) -> dict:
        """vLLM's speculative-decoding counters so far: drafts, draft_tokens, accepted_tokens,
        accepted_per_position."""
        return self._ask({"metrics": True})

    def _log_tail(self, lines: int = 60) -> str:
        """The worker's stderr for an error message ("" if it wrote none): from its first error on (vLLM
        logs the root cause of a failed start before the traceback that ends the log), at most `lines`
        lines, the first and the last half when longer."""
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        first = next((i for i, line in enumerate(text) if "ERROR" in line or "Traceback" in line), 0)
        text = text[first:]
        if len(text) > lines:
            text = [*text[: lines // 2], "...", *text[-(lines // 2) :]]
        where = "" if self._own_log else f" (whole log: {self.log_path})"
        return f"; its log{where}:\n" + "\n".join(text) if text else ""

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self._own_log:
            self.log_path.unlink(missing_ok=True)

    def __del__(self):  # best effort: never leave an engine running
        try:
            self.close()
        except Exception:  # noqa: BLE001
            print("treespec: could not stop the vLLM worker", file=sys.stderr)
