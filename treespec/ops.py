"""The compiled tree-attention ops (csrc/): JIT build, loading, torch.library registration, wrappers.

Nothing is built at import. The first call that needs an op (`available()`, `tree_attention`,
`commit_kv`) compiles csrc/ with `torch.utils.cpp_extension.load` (ninja) into
`$TREESPEC_CACHE/ext/<name>/` (default `~/.cache/treespec/ext/`); the name carries a hash of the
sources, the flags, torch, Python and the CPU, so a second process loads the built library directly
(about 0.1 s) and a change to any of them builds afresh. The CUDA kernel is compiled in only where
torch has CUDA (and nvcc is found). Where the build is impossible (no compiler, no ninja) or fails,
one warning says why and treespec runs on the torch paths (SDPA attention, the reference commit).
`TREESPEC_NO_EXT=1` turns the extension off without a warning; `TREESPEC_EXT_VERBOSE=1` shows the
compiler output.

Ops (namespace `torch.ops.treespec`, traceable by torch.compile through the fake kernels below):

    tree_attention(q, k, v, bits, scale) -> out
        q: [B, H, n, D]; k, v: [B, Hkv, L, D] (views of the cache, any strides with a contiguous last
        dim; H a multiple of Hkv, never expanded); bits: [n, ceil(n/64)] int64 ancestor words
        (treespec.core.tree.pack_bits) or None for causal; out: [B, n, H, D] contiguous, q's dtype.
        Keys [0, L - n) are visible to every query; the last n keys are the tree block.
    tree_attention_out(q, k, v, bits, scale, out) -> None
        The same, written into a caller's contiguous [B, n, H, D] buffer (no allocation).
        CPU: float32, bfloat16. CUDA: float32, float16, bfloat16; head_dim 64, 128 or 256.
    block_linear(x, q, d, m) -> out
        x [..., K] float32 @ w^T -> [..., N] where w [N, K] is stored as exact block-quantized values
        (csrc/block_linear.h; treespec.core.blocks recovers them): q4 (m given) or q8 (m None).
    commit_kv(keys, values, src, dst) -> None
        For each tensor (every layer's keys and values, [B, Hkv, max_len, D], same shape, strides and
        dtype; elements of 1, 2, 4 or 8 bytes) copy slot src[i] to slot dst[i], i in order, in one
        call for all layers. In order means a move may read a slot an earlier move wrote; for a
        commit path (dst increasing, src[i] >= dst[i]) that never happens and the result equals
        gather-then-scatter.
    argmax_rows(x) -> index
        x [..., V] float32 or bfloat16 on the CPU -> int64 [...]: what x.max(dim=-1).indices gives (a
        row's first NaN, else its first maximum), without torch's per-call cost (`argmax_rows` below).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from .io import cache_root

_SOURCES_CPU = (
    "bindings.cpp",
    "tree_attention_cpu.cpp",
    "block_linear_cpu.cpp",
    "exact_attention_cpu.cpp",
    "exact_linear_cpu.cpp",
    "native_step_cpu.cpp",
    "native_bindings.cpp",
    "int8_linear_cpu.cpp",
    "argmax_cpu.cpp",
    "native_heads.cpp",
)
_SOURCES_CUDA = ("bindings_cuda.cpp", "tree_attention_cuda.cu")
_HEADERS = (
    "tree_attention.h",
    "tensor_args.h",
    "block_linear.h",
    "exact.h",
    "vec.h",
    "native_step.h",
    "argmax.h",
    "int8_linear.h",
    "linear_slots.h",
)

_lock = threading.Lock()
_state: dict = {"tried": False, "ok": False, "cuda": False, "error": None, "path": None, "seconds": None}


class ExtensionUnavailable(RuntimeError):
    """The compiled ops could not be built or loaded (the message says why and what to do)."""


def csrc_dir() -> Path:
    """Where the C++/CUDA sources are: `treespec/csrc` in an installed wheel, `csrc/` in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "csrc", here.parent / "csrc"):
        if (candidate / "tree_attention_cpu.cpp").is_file():
            return candidate
    raise ExtensionUnavailable(
        f"the csrc/ sources are not next to {here} (reinstall treespec, or set TREESPEC_NO_EXT=1)"
    )


def _cpu_identity() -> str:
    """What -march=native compiles for: the machine and its CPU feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    return platform.machine() + flags


def _want_cuda() -> bool:
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None


def _flags(cuda: bool) -> tuple[list[str], list[str]]:
    cflags = ["-O3", "-fopenmp", "-Wno-unused-function"]
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        cflags += ["-march=native", "-mprefer-vector-width=512"]
    elif machine in ("aarch64", "arm64"):
        cflags += ["-mcpu=native"]
    extra = os.environ.get("TREESPEC_EXT_CFLAGS")
    if extra is not None:  # replaces the architecture flags, e.g. "-march=x86-64-v3"
        cflags = ["-O3", "-fopenmp", *extra.split()]
    cuda_flags = ["-O3", "--use_fast_math", "-lineinfo"] if cuda else []
    if cuda:
        cflags.append("-DTREESPEC_WITH_CUDA")
        cuda_flags.append("-DTREESPEC_WITH_CUDA")
    return cflags, cuda_flags


def _build_name(sources: list[Path], cflags: list[str], cuda_flags: list[str]) -> str:
    h = hashlib.sha256()
    for path in sorted(sources, key=lambda p: p.name):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    for item in (
        *cflags,
        "|",
        *cuda_flags,
        torch.__version__,
        str(torch.version.cuda),
        sys.version,
        _cpu_identity(),
    ):
        h.update(item.encode())
    return f"treespec_ops_{h.hexdigest()[:12]}"


def _register_fakes() -> None:
    """Fake (meta) kernels, so torch.compile / FakeTensor tracing sees shapes without running."""

    def attention(q, *rest):  # q [B, H, n, D] (rows: [A, H, n, D]) -> [B, n, H, D]
        B, H, n, D = q.shape
        return q.new_empty((B, n, H, D))

    def linear(x, w, *rest):  # x [..., K] and w [N, K] (or its blocks) -> [..., N]
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    def in_place(*args):  # writes into its arguments
        return None

    def argmax(x):  # x [..., V] -> int64 [...]
        return x.new_empty(x.shape[:-1], dtype=torch.long)

    fakes = {
        "tree_attention": attention,
        "tree_attention_rows": attention,
        "tree_attention_exact": attention,
        "tree_attention_exact_rows": attention,
        "tree_attention_out": in_place,
        "commit_kv": in_place,
        "block_linear": linear,
        "exact_linear": linear,
        "argmax_rows": argmax,
    }
    for name, fake in fakes.items():
        torch.library.register_fake(f"treespec::{name}", fake)


def _build_and_load() -> None:
    from torch.utils import cpp_extension

    src = csrc_dir()
    cuda = _want_cuda()
    names = list(_SOURCES_CPU) + (list(_SOURCES_CUDA) if cuda else [])
    sources = [src / s for s in names]
    cflags, cuda_flags = _flags(cuda)
    name = _build_name(sources + [src / h for h in _HEADERS], cflags, cuda_flags)
    build_dir = cache_root() / "ext" / name
    library = build_dir / f"{name}.so"
    start = time.perf_counter()
    if library.is_file():
        try:  # built by an earlier process: no ninja run at all
            torch.ops.load_library(str(library))
            _finish(library, cuda, start)
            return
        except OSError:
            pass  # a half-written library: rebuild below
    build_dir.mkdir(parents=True, exist_ok=True)
    verbose = os.environ.get("TREESPEC_EXT_VERBOSE", "") not in ("", "0")
    with _exclusive_build(build_dir):
        if library.is_file():  # another process built it while this one waited
            try:
                torch.ops.load_library(str(library))
                _finish(library, cuda, start)
                return
            except OSError:
                pass  # a half-written library: rebuild below
        print(
            f"treespec: compiling the tree-attention kernels{' (with CUDA)' if cuda else ''} into "
            f"{build_dir} (first use only; about half a minute)",
            file=sys.stderr,
            flush=True,
        )
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=cflags,
            extra_cuda_cflags=cuda_flags,
            extra_include_paths=[str(src)],
            build_directory=str(build_dir),
            with_cuda=cuda,
            is_python_module=False,
            verbose=verbose,
        )
    _finish(library, cuda, start)


@contextlib.contextmanager
def _exclusive_build(build_dir: Path):
    """One build per folder at a time, across processes, and no wait on a dead build.

    torch's `cpp_extension.load` marks a build with a `lock` file that it removes when done; a build
    that was killed leaves the file, and every later load of the same sources would wait on it forever.
    Here each build first takes an advisory lock (`flock`, which the OS drops when its process dies)
    on `build.flock`: whoever holds it is the only live builder, so a `lock` file found then is a dead
    build's and is removed."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's own lock file alone
        yield
        return
    with open(build_dir / "build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                print(
                    f"treespec: removing {stale}, left by an extension build that did not finish",
                    file=sys.stderr,
                    flush=True,
                )
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _finish(library: Path, cuda: bool, start: float) -> None:
    _register_fakes()
    _state.update(ok=True, cuda=cuda, path=str(library), seconds=time.perf_counter() - start)


def load() -> bool:
    """Build (first time) and load the ops; True when they are usable. Warns once on failure."""
    if _state["tried"]:
        return _state["ok"]
    with _lock:
        if _state["tried"]:
            return _state["ok"]
        if os.environ.get("TREESPEC_NO_EXT", "") not in ("", "0"):
            _state.update(tried=True, error="disabled by TREESPEC_NO_EXT")
            return False
        try:
            _build_and_load()
        except Exception as exc:  # no compiler, no ninja, a compile error: all fall back the same way
            message = str(exc).strip().splitlines()
            reason = f"{type(exc).__name__}: {message[-1] if message else ''}"
            _state.update(error=reason)
            warnings.warn(
                "treespec: the compiled tree-attention extension could not be built or loaded "
                f"({reason}); using the torch paths instead (SDPA tree attention, reference KV commit), "
                "which give the same results more slowly. Install a C++ compiler and ninja "
                "(pip install ninja) to get the kernels, TREESPEC_EXT_VERBOSE=1 shows the build log, "
                "TREESPEC_NO_EXT=1 silences this.",
                RuntimeWarning,
                stacklevel=3,
            )
        finally:
            _state["tried"] = True
    return _state["ok"]


def available(device: torch.device | str | None = None) -> bool:
    """Whether the compiled ops can run (on `device`, default CPU); builds them on the first call."""
    if not load():
        return False
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        return _state["cuda"]
    return device.type == "cpu"


def build_info() -> dict:
    """What `load` did: ok, cuda, the library path, seconds to build or load, the error if any."""
    return {k: _state[k] for k in ("tried", "ok", "cuda", "path", "seconds", "error")}


CPU_DTYPES = (torch.float32, torch.bfloat16)
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CUDA_HEAD_DIMS = (64, 128, 256)


def dtype_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the compiled tree attention takes `dtype` on `device` (without building anything)."""
    kind = torch.device(device).type
    return (kind == "cpu" and dtype in CPU_DTYPES) or (kind == "cuda" and dtype in CUDA_DTYPES)


def unsupported_reason(query: torch.Tensor, key: torch.Tensor) -> str | None:
    """None when the compiled tree_attention takes these inputs (without building), else why not."""
    device = query.device.type
    if device == "cpu":
        if query.dtype not in CPU_DTYPES:
            return f"{query.dtype} on CPU (the kernel takes {CPU_DTYPES})"
    elif device == "cuda":
        if query.dtype not in CUDA_DTYPES:
            return f"{query.dtype} on CUDA (the kernel takes {CUDA_DTYPES})"
        if query.shape[-1] not in CUDA_HEAD_DIMS:
            return f"head_dim {query.shape[-1]} on CUDA (the kernel takes {CUDA_HEAD_DIMS})"
        if query.shape[1] // key.shape[1] > 32:
            return "more than 32 query heads per KV head on CUDA"
    else:
        return f"device {device}"
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        return "autograd (the kernel is inference-only)"
    return None


def _require(device: torch.device) -> None:
    if not available(device):
        why = _state["error"] or f"built without {device.type} support"
        raise ExtensionUnavailable(f"treespec's compiled ops are not available on {device}: {why}")


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bits: torch.Tensor | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compiled tree attention: q [B, H, n, D], k/v [B, Hkv, L, D], bits [n, W] or None -> [B, n, H, D].

    out: optional contiguous [B, n, H, D] buffer to write into (returned)."""
    _require(q.device)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if out is not None:
        torch.ops.treespec.tree_attention_out(q, k, v, bits, float(scale), out)
        return out
    return torch.ops.treespec.tree_attention(q, k, v, bits, float(scale))


def tree_attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bits: torch.Tensor | None,
    scale: float,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
) -> torch.Tensor:
    """Compiled tree attention for rows with their own committed lengths: q [A, H, n, D] over the
    cache's k/v [B, Hkv, L, D]; query row a reads cache row rows[a], keys [0, prefix_lens[a] + n);
    rows, prefix_lens: int64 [A] CPU tensors. Returns [A, n, H, D]."""
    _require(q.device)
    return torch.ops.treespec.tree_attention_rows(q, k, v, bits, float(scale), rows, prefix_lens)


def commit_kv(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    src: torch.Tensor | list[int],
    dst: torch.Tensor | list[int],
) -> None:
    """Fused commit: in every keys/values tensor [B, Hkv, max_len, D], slot src[i] -> dst[i] in order.
    src / dst: int64 on the CPU (lists become CPU tensors) or on the cache's device; a move outside the
    cache raises RuntimeError on every device (CUDA reads device indices back to check them: one sync)."""
    device = keys[0].device
    _require(device)
    if not isinstance(src, torch.Tensor):
        src = torch.tensor(src, dtype=torch.long)
    if not isinstance(dst, torch.Tensor):
        dst = torch.tensor(dst, dtype=torch.long)
    torch.ops.treespec.commit_kv(list(keys), list(values), src, dst)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] -> int64 [...]: x.max(dim=-1).indices (the first maximum; a row's first NaN if it has
    one), by the compiled op for float32 / bfloat16 CPU tensors when the extension is loaded (torch's max
    over a 49k vocabulary costs ~100 us a row on a small CPU), else by torch."""
    if x.device.type == "cpu" and x.dtype in CPU_DTYPES and x.shape[-1] > 0 and load():
        return torch.ops.treespec.argmax_rows(x)
    return x.max(dim=-1).indices
