"""Python binding of the C core (runtime/, libpyrt) through cffi in ABI mode.

Layers, as in llama-cpp-python: `_lib()` holds the raw cffi functions; `CpuCore` owns a thread pool
(freed deterministically by close(), `with`, or garbage collection) and raises `CoreError` with the
C library's last_error message when a call fails; `moe_ffn` is the API the MoE layer calls.

The library is found, in order, at $PYRUNTIME_CORE_LIB, in the pyruntime package folder (where
`pip install` and `pip install -e .` put it), or in ./build (a plain `cmake -S . -B build`). Its
cffi declarations are the PYRT_CDEF section of pyrt.h, read from beside the library (every build
puts it there) or else from the source tree (runtime/include/pyrt.h).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from cffi import FFI

from pyruntime import options
from pyruntime.errors import PyruntimeError

# ggml type numbers of the weight formats the core reads (gguf.GGMLQuantizationType values; the
# PYRT_FMT_* enum of runtime/include/pyrt.h).
FMT_F32, FMT_F16, FMT_Q4_0, FMT_Q8_0, FMT_BF16 = 0, 1, 2, 8, 30
FMT_Q5_0, FMT_Q5_1, FMT_Q4_K, FMT_Q5_K, FMT_Q6_K, FMT_MXFP4 = 6, 7, 12, 13, 14, 39
FORMATS = {
    FMT_F32: "F32",
    FMT_F16: "F16",
    FMT_BF16: "BF16",
    FMT_Q8_0: "Q8_0",
    FMT_Q4_0: "Q4_0",
    FMT_Q5_0: "Q5_0",
    FMT_Q5_1: "Q5_1",
    FMT_Q4_K: "Q4_K",
    FMT_Q5_K: "Q5_K",
    FMT_Q6_K: "Q6_K",
    FMT_MXFP4: "MXFP4",
}

# Activation names as in docs/gguf-layout.md (`pyruntime.expert_activation`) -> C enum.
ACTIVATIONS = {
    "silu": 0,
    "gelu": 1,
    "gelu_tanh": 1,
    "gelu_pytorch_tanh": 1,
    "gelu_exact": 2,
    "swiglu_oai": 3,
}

SIMD_LEVELS = {"scalar": 0, "avx2": 1, "avx512": 2}

_LIB_NAMES = {"linux": "libpyrt.so", "darwin": "libpyrt.dylib", "win32": "pyrt.dll"}


class CoreError(PyruntimeError):
    """The C core refused a call (bad arguments, no memory) or could not be loaded."""


class CoreTimeout(CoreError):
    """A C call's wait for another device's signal ran out (PYRT_E_TIMEOUT)."""


_ffi = FFI()  # declarations: the PYRT_CDEF section of the library's pyrt.h, read by _lib()
_lib_handle = None
_lib_lock = threading.Lock()
# pointer types parsed once (a cast by type name parses the name on every call)
_P_FLOAT = _ffi.typeof("float *")
_P_CFLOAT = _ffi.typeof("const float *")
_P_CINT32 = _ffi.typeof("const int32_t *")
_P_INT64 = _ffi.typeof("int64_t *")

_PACKAGE = Path(__file__).resolve().parents[1]  # pyruntime/: where the build installs the library
_SOURCE_HEADER = _PACKAGE.parent / "runtime" / "include" / "pyrt.h"  # in a source checkout
_CDEF_BEGIN, _CDEF_END = "/* PYRT_CDEF_BEGIN */", "/* PYRT_CDEF_END */"


def _candidate_paths() -> list[Path]:
    name = _LIB_NAMES.get(sys.platform, "libpyrt.so")
    override = options.value("core_lib")
    if override:
        return [Path(override)]
    return [_PACKAGE / name, _PACKAGE.parent / "build" / name]


def find_header(library: Path) -> Path:
    """The pyrt.h that declares `library`: the one beside it (every build puts it there, so a
    library and its declarations match), else the source tree's; CoreError naming both if none."""
    paths = [library.parent / "pyrt.h", _SOURCE_HEADER]
    found = next((p for p in paths if p.is_file()), None)
    if found is None:
        tried = ", ".join(str(p) for p in paths)
        raise CoreError(
            f"C core header pyrt.h not found for {library} (tried {tried}): rebuild the library "
            "(its build puts pyrt.h beside it)"
        )
    return found


def cdef_section(header: Path) -> str:
    """The PYRT_CDEF_BEGIN..END section of a pyrt.h: plain C declarations, comments included,
    which cffi's cdef parser takes as they are."""
    text = header.read_text()
    begin, end = text.find(_CDEF_BEGIN), text.find(_CDEF_END)
    if begin < 0 or end < begin:
        raise CoreError(f"{header} has no {_CDEF_BEGIN} ... {_CDEF_END} section")
    return text[begin + len(_CDEF_BEGIN) : end]


def _lib():
    """The loaded library (loaded once per process), declared from its pyrt.h."""
    global _lib_handle
    with _lib_lock:
        if _lib_handle is None:
            paths = _candidate_paths()
            found = next((p for p in paths if p.is_file()), None)
            if found is None:
                tried = ", ".join(str(p) for p in paths)
                raise CoreError(
                    f"C core library not found (tried {tried}): build it with `pip install -e .` "
                    "in the repository, or point PYRUNTIME_CORE_LIB at a libpyrt build"
                )
            header = find_header(found)
            _ffi.cdef(cdef_section(header))
            try:
                lib = _ffi.dlopen(str(found))
            except OSError as exc:
                raise CoreError(
                    f"cannot load the C core {found}: {exc}; rebuild it with `pip install -e .`"
                ) from exc
            _check_api(lib, found, header)
            _lib_handle = lib
        return _lib_handle


def _check_api(lib, library: Path, header: Path) -> None:
    """CoreError unless the library was built from a header of the same API version as the one
    it is declared from (a stale build would otherwise be called with other signatures)."""
    try:
        built = int(lib.pyrt_api_version())
    except AttributeError:  # built before the API had a version
        built = 1
    if built != lib.PYRT_API_VERSION:
        raise CoreError(
            f"the C core {library} was built from API version {built} but {header} declares "
            f"version {lib.PYRT_API_VERSION}: rebuild it (`pip install -e .`, or cmake --build)"
        )


def _check(status: int, what: str) -> None:
    if status != 0:
        message = _ffi.string(_lib().pyrt_last_error()).decode("utf-8", "replace")
        raise CoreError(message or f"{what} failed with status {status}")


def physical_cores() -> int:
    """Physical cores this process may run on (SMT siblings counted once)."""
    return int(_lib().pyrt_physical_cores())


def logical_cpus() -> int:
    """Logical CPUs this process may run on (its affinity mask)."""
    return int(_lib().pyrt_logical_cpus())


def ubatch_default() -> int:
    """Prefill tokens per chunk when none is given (PYRT_UBATCH_DEFAULT)."""
    return int(_lib().PYRT_UBATCH_DEFAULT)


def simd_level() -> str:
    """The SIMD level the kernels use now: 'scalar', 'avx2' or 'avx512'."""
    level = int(_lib().pyrt_simd_active())
    return next(name for name, value in SIMD_LEVELS.items() if value == level)


def simd_best() -> str:
    """The best SIMD level this CPU supports."""
    level = int(_lib().pyrt_simd_best())
    return next(name for name, value in SIMD_LEVELS.items() if value == level)


def force_simd(level: str) -> None:
    """Use a lower SIMD level process-wide (tests, benchmarks). Not safe while kernels run."""
    if level not in SIMD_LEVELS:
        raise CoreError(f"unknown SIMD level {level!r}: use one of {', '.join(SIMD_LEVELS)}")
    _check(_lib().pyrt_simd_force(SIMD_LEVELS[level]), "pyrt_simd_force")


def row_bytes(fmt: int, n: int) -> int:
    """Bytes of one row of n elements in format fmt (0 when fmt is unknown or n does not fit)."""
    return int(_lib().pyrt_row_bytes(fmt, n))


K_QUANT_FORMATS = (FMT_Q4_K, FMT_Q5_K, FMT_Q6_K)  # what quantize_rows writes


def quantize_rows(rows: np.ndarray, fmt: int, core: CpuCore | None = None) -> np.ndarray:
    """float32 rows [r, n] (n a multiple of 256) -> uint8 [r, row bytes] in fmt (FMT_Q4_K,
    FMT_Q5_K or FMT_Q6_K): llama-quantize's bytes (ggml's reference quantizers, no importance
    matrix). With `core`, the super-blocks are split across its pool's threads (same bytes)."""
    x = np.ascontiguousarray(rows, dtype=np.float32)
    if x.ndim != 2:
        raise CoreError(f"quantize_rows takes rows [r, n], got shape {tuple(x.shape)}")
    n_rows, n = x.shape
    size = row_bytes(fmt, n) if fmt in K_QUANT_FORMATS else 0
    out = np.empty((n_rows, size), np.uint8)
    pool = _ffi.NULL if core is None else core._pool_or_raise()
    src = _ffi.cast(_P_CFLOAT, x.ctypes.data)
    status = _lib().pyrt_quantize_rows(pool, fmt, src, n_rows, n, _ffi.from_buffer(out), out.nbytes)
    _check(status, "pyrt_quantize_rows")
    return out


def dequantize_rows(raw: np.ndarray, fmt: int, n: int, core: CpuCore | None = None) -> np.ndarray:
    """Rows of n elements in fmt (FMT_Q4_K, FMT_Q5_K or FMT_Q6_K; raw: their bytes, uint8
    [r, row bytes] or flat) -> float32 [r, n], ggml's values. With `core`: on its pool."""
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    size = row_bytes(fmt, n) if fmt in K_QUANT_FORMATS else 0
    n_rows = -(-data.nbytes // size) if size else 0  # a partial row: the C call names it
    out = np.empty((n_rows, n), np.float32)
    pool = _ffi.NULL if core is None else core._pool_or_raise()
    src = _ffi.from_buffer(data)
    status = _lib().pyrt_dequantize_rows(
        pool, fmt, src, data.nbytes, n_rows, n, _ffi.cast(_P_FLOAT, out.ctypes.data)
    )
    _check(status, "pyrt_dequantize_rows")
    return out


def default_params() -> dict[str, int]:
    """The pool's execution parameters and their defaults (pyrt_params in runtime/include/pyrt.h:
    what each field trades). Every setting gives the same results; they change speed only."""
    lib = _lib()
    p = _ffi.new("pyrt_params *")
    lib.pyrt_params_default(p)
    return {name: getattr(p, name) for name, _ in _ffi.typeof("pyrt_params").fields}


def _params(values: dict[str, int] | None):
    """A pyrt_params * holding the defaults updated with `values` (NULL for None)."""
    if values is None:
        return _ffi.NULL
    lib = _lib()
    p = _ffi.new("pyrt_params *")
    lib.pyrt_params_default(p)
    fields = [name for name, _ in _ffi.typeof("pyrt_params").fields]
    for name, value in values.items():
        if name not in fields:
            raise CoreError(f"unknown C core parameter {name!r}: use one of {', '.join(fields)}")
        if not isinstance(value, int):  # bool is one: a switch given as True/False
            raise CoreError(f"C core parameter {name} must be an integer, got {value!r}")
        setattr(p, name, int(value))
    return p


class MoeCall:
    """A pyrt_moe_ffn call with its arguments bound (CpuCore.bind_moe). Calling it runs the
    layer on the bound buffers' current contents and returns n_active (moe_ffn's)."""

    __slots__ = ("_core", "_args", "_keep")

    def __init__(self, core: CpuCore, args: tuple, keep: tuple) -> None:
        self._core, self._args, self._keep = core, args, keep  # keep: what args point into

    def __call__(self) -> int:
        core = self._core
        if core._pool is None:
            raise CoreError("CpuCore is closed: create a new one")
        _check(core._lib.pyrt_moe_ffn(*self._args), "pyrt_moe_ffn")
        return int(self._args[-1][0])


class HostStep:
    """pyrt_moe_host_step bound (CpuCore.bind_host_step): the host's turns of one hybrid decode
    step, every MoE layer's in one C call. Calling it with the step's number runs them and
    returns (seconds waiting for the graph's flags, seconds computing); what each layer's
    routing held is then in ids_log / codes_log [n_layers, k] (and logits_log [n_layers,
    n_expert] where bound with logits), the neurons each computed in n_active [n_layers]."""

    __slots__ = ("_core", "_step", "_ns", "_keep", "ids_log", "codes_log", "logits_log",
                 "n_active")  # fmt: skip

    def __init__(self, core: CpuCore, step, logs: tuple, keep: tuple) -> None:
        self._core, self._step, self._keep = core, step, keep  # keep: what step points into
        self._ns = _ffi.new("int64_t[2]")
        self.ids_log, self.codes_log, self.logits_log, self.n_active = logs

    def __call__(self, seq: int) -> tuple[float, float]:
        core = self._core
        if core._pool is None:
            raise CoreError("CpuCore is closed: create a new one")
        status = core._lib.pyrt_moe_host_step(core._pool, self._step, seq, self._ns)
        if status == core._lib.PYRT_E_TIMEOUT:
            raise CoreTimeout(_ffi.string(core._lib.pyrt_last_error()).decode())
        _check(status, "pyrt_moe_host_step")
        return self._ns[0] * 1e-9, self._ns[1] * 1e-9


class CpuCore:
    """Owner of the C core's thread pool; computes routed experts on the CPU.

    One per process is enough (calls on it are serialized). Free it with close() or `with`;
    garbage collection frees it too. params: execution parameters that differ from the defaults
    (names and defaults: default_params(); what each trades: pyrt_params in pyrt.h), e.g.
    {"fuse_layer": 0}; every setting gives the same results.
    """

    def __init__(self, threads: int | None = None, params: dict[str, int] | None = None) -> None:
        lib = _lib()
        self._lib = lib  # the build that made the pool frees it and runs its calls
        # bound now: a first lookup of a lib function takes cffi's lock, and __del__ may run
        # from a garbage collection inside another cffi call that holds it (a deadlock)
        self._pool_free = lib.pyrt_pool_free
        self._pool = None
        n = physical_cores() if threads is None else threads
        if not isinstance(n, int) or isinstance(n, bool):
            raise CoreError(f"threads must be an integer, got {threads!r}")
        out = _ffi.new("pyrt_pool **")
        _check(lib.pyrt_pool_create(n, _params(params), out), "pyrt_pool_create")
        self._pool = out[0]
        self.threads = n
        self.params = {**default_params(), **(params or {})}

    def _pool_or_raise(self):
        if self._pool is None:
            raise CoreError("CpuCore is closed: create a new one")
        return self._pool

    def close(self) -> None:
        """Stop the worker threads and free the pool (idempotent)."""
        if self._pool is not None:
            self._pool_free(self._pool)
            self._pool = None

    def __enter__(self) -> CpuCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_pool", None) is not None and _lib_handle is not None:
            self.close()

    def moe_ffn(
        self,
        gud: np.ndarray,
        fmt: int,
        n_expert: int,
        n_ff: int,
        n_embd: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_w: torch.Tensor,
        activation: str = "silu",
        threshold: float | None = None,
        out: torch.Tensor | None = None,
        expert_map: torch.Tensor | None = None,
        bias: tuple[torch.Tensor, torch.Tensor] | None = None,
        swiglu: tuple[float, float] = (1.702, 7.0),
        gates: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, int]:
        """Routed experts of one layer: y[t] = sum_k topk_w[t, k] * expert_{topk_ids[t, k]}(x[t]).

        gud: the layer's `ffn_gud_exps` tensor data, raw bytes or a typed view of the GGUF mmap
        (read in place, never copied), layout [n_expert, n_ff, 3, n_embd] of docs/gguf-layout.md
        (with expert_map: [n_slots, n_ff, 3, n_embd], n_slots from its size).
        fmt: ggml type number (0 F32, 1 F16, 30 BF16, 8 Q8_0, 2 Q4_0).
        x: [T, n_embd] float32; topk_ids: [T, K] int32/int64 in [0, n_expert); topk_w: [T, K].
        threshold: None or 0 = dense; > 0 = a neuron whose |act(gate . x)| < threshold is skipped.
        out: None, or a contiguous float32 CPU tensor [T, n_embd] that receives y (overwritten, not
        added to), so a caller that calls per token reuses one buffer instead of a new tensor.
        expert_map: None (gud holds every expert), or int [n_expert]: expert id -> its slot in
        gud, -1 = not held here: that id's (token, expert) pairs are skipped and add nothing to y
        (vLLM's fused_moe expert_map; a cache of slots, or one device's share of the experts).
        bias: None, or float32 (gate_up [n_slots, n_ff, 2], down [n_slots, n_embd]) indexed like
        gud (gpt-oss's expert biases); swiglu: (alpha, limit) of activation 'swiglu_oai'.
        gates: None, or C-contiguous [n_slots, n_ff, row_bytes] bytes: every neuron's gate row
        apart (pyruntime.experts.gates.gates_apart), which the sparse pass reads instead of
        gud's (the same values: the same result).
        Returns (y [T, n_embd] float32, n_active): n_active counts the neurons computed, summed over
        the (token, expert) pairs computed (their number * n_ff when dense); y is `out` when given.
        """
        args = self._moe_args(gud, fmt, n_expert, n_ff, n_embd, x, topk_ids, topk_w, activation,
                              threshold, out, expert_map, bias, swiglu, gates)  # fmt: skip
        if args is None:  # no tokens
            return (torch.empty((0, n_embd), dtype=torch.float32) if out is None else out), 0
        y, call_args, _ = args
        _check(self._lib.pyrt_moe_ffn(*call_args), "pyrt_moe_ffn")
        return y, int(call_args[-1][0])

    def bind_moe(
        self,
        gud: np.ndarray,
        fmt: int,
        n_expert: int,
        n_ff: int,
        n_embd: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_w: torch.Tensor,
        out: torch.Tensor,
        expert_map: torch.Tensor | None = None,
        activation: str = "silu",
        threshold: float | None = None,
        bias: tuple[torch.Tensor, torch.Tensor] | None = None,
        swiglu: tuple[float, float] = (1.702, 7.0),
    ) -> MoeCall:
        """moe_ffn's call with every argument bound once (checked and marshalled now): the
        returned MoeCall runs the layer on what x, topk_ids, topk_w and expert_map hold when
        it is called, into out, and returns n_active. For a caller that runs one layer again
        and again on buffers at fixed addresses (a hybrid decode step's page-locked routing
        buffers), where moe_ffn's checks and marshalling cost ~60 us a call in Python. The
        tensors must already be what moe_ffn would pass on unconverted (contiguous CPU float32
        x / topk_w / out, int32 topk_ids and expert_map): a converted copy would not see the
        caller's later writes."""
        for name, t, dtype, ndim in (("x", x, torch.float32, 2), ("topk_ids", topk_ids,
                                     torch.int32, 2), ("topk_w", topk_w, torch.float32, 2),
                                     ("expert_map", expert_map, torch.int32, 1)):  # fmt: skip
            if t is not None and _as_cpu(t, dtype, name, ndim) is not t:
                raise CoreError(f"{name} to bind must be a contiguous CPU {dtype} tensor of "
                                f"{ndim} dimensions, got {_describe(t)}")  # fmt: skip
        args = self._moe_args(gud, fmt, n_expert, n_ff, n_embd, x, topk_ids, topk_w, activation,
                              threshold, out, expert_map, bias, swiglu, None)  # fmt: skip
        if args is None:
            raise CoreError("a bound expert call needs at least one token")
        _, call_args, keep = args
        return MoeCall(self, call_args, keep)

    def bind_host_step(
        self,
        layers: Sequence[tuple[np.ndarray, float | None, tuple | None]],
        fmt: int,
        n_expert: int,
        n_ff: int,
        n_embd: int,
        routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        out: torch.Tensor,
        flags: torch.Tensor,
        code: int,
        activation: str = "silu",
        swiglu: tuple[float, float] = (1.702, 7.0),
        logits: torch.Tensor | None = None,
        timeout_s: float = 30.0,
    ) -> HostStep:
        """pyrt_moe_host_step with every argument bound once (pyrt.h): the host's side of a
        hybrid decode step over len(layers) MoE layers, each (expert weights [n_expert, n_ff,
        3, row] as for moe_ffn, threshold or None, biases or None). routing = (x [1, n_embd]
        f32, ids [1, k] int32, weights [1, k] f32, codes [1, k] int32): the buffers the graph
        writes each layer's routing into; out [1, n_embd] f32 the host's share (y); flags [2,
        n_layers] int32; the pairs coded `code` are computed here; logits [1, n_expert] f32:
        logged per layer as well. Every tensor contiguous on the CPU as moe_ffn takes it: the
        call reads them where they are."""
        x, ids, w, codes = routing
        k = ids.shape[1]
        n_layers = len(layers)
        f32, i32 = torch.float32, torch.int32
        for name, t, dtype, shape in (("x", x, f32, (1, n_embd)), ("ids", ids, i32, (1, k)),
                                      ("weights", w, f32, (1, k)), ("codes", codes, i32, (1, k)),
                                      ("out", out, f32, (1, n_embd)),
                                      ("flags", flags, i32, (2, n_layers)),
                                      ("logits", logits, f32, (1, n_expert))):  # fmt: skip
            if t is not None and (_as_cpu(t, dtype, name, 2) is not t or t.shape != shape):
                raise CoreError(f"{name} to bind must be a contiguous CPU {dtype} tensor of "
                                f"shape {shape}, got {_describe(t)}")  # fmt: skip
        experts, values, keep = [], [], [x, ids, w, codes, out, flags, logits]
        for gud, threshold, bias in layers:  # each layer's experts and threshold as moe_ffn's
            _, call_args, layer_keep = self._moe_args(gud, fmt, n_expert, n_ff, n_embd, x, ids,
                                                      w, activation, threshold, out, None, bias,
                                                      swiglu, None)  # fmt: skip
            experts.append(call_args[1])
            values.append(call_args[8])
            keep.append(layer_keep)
        array = _ffi.new("const pyrt_experts *[]", experts)
        thresholds = _ffi.new("float[]", values)  # checked by the C call before any layer runs
        ids_log = np.zeros((n_layers, k), dtype=np.int32)
        codes_log = np.zeros((n_layers, k), dtype=np.int32)
        logits_log = None if logits is None else np.zeros((n_layers, n_expert), np.float32)
        n_active = np.zeros(n_layers, dtype=np.int64)

        def ptr(kind: str, a) -> object:
            if a is None:
                return _ffi.NULL
            return _ffi.cast(kind, a.data_ptr() if isinstance(a, torch.Tensor) else
                             a.ctypes.data)  # fmt: skip

        step = _ffi.new("pyrt_host_step *", {
            "n_layers": n_layers, "k": k, "code": code, "activation": ACTIVATIONS[activation],
            "layers": array, "thresholds": thresholds,
            "x": ptr("const float *", x), "ids": ptr("const int32_t *", ids),
            "w": ptr("const float *", w), "codes": ptr("const int32_t *", codes),
            "y": ptr("float *", out), "flags": ptr("int32_t *", flags),
            "ids_log": ptr("int32_t *", ids_log), "codes_log": ptr("int32_t *", codes_log),
            "logits": ptr("const float *", logits), "n_logits": 0 if logits is None else n_expert,
            "logits_log": ptr("float *", logits_log), "n_active": ptr("int64_t *", n_active),
            "timeout_ns": int(timeout_s * 1e9),
        })  # fmt: skip
        keep += [experts, array, thresholds]
        return HostStep(self, step, (ids_log, codes_log, logits_log, n_active), tuple(keep))

    def _moe_args(self, gud, fmt, n_expert, n_ff, n_embd, x, topk_ids, topk_w, activation,
                  threshold, out, expert_map, bias, swiglu, gates):  # fmt: skip
        """(y, pyrt_moe_ffn's arguments, what they point into) of a moe_ffn call, checked;
        None when there are no tokens."""
        if self._pool is None:
            raise CoreError("CpuCore is closed: create a new one")
        if activation not in ACTIVATIONS:
            raise CoreError(
                f"unknown expert activation {activation!r}: use one of {', '.join(ACTIVATIONS)}"
            )
        if not isinstance(gud, np.ndarray) or not gud.flags.c_contiguous:
            raise CoreError("expert weights must be a C-contiguous numpy array (the mmap view)")
        x = _as_cpu(x, torch.float32, "x", 2)
        topk_w = _as_cpu(topk_w, torch.float32, "topk_w", 2)
        topk_ids = _as_cpu(topk_ids, torch.int32, "topk_ids", 2)
        n_tokens, k = topk_ids.shape
        if x.shape != (n_tokens, n_embd) or topk_w.shape != (n_tokens, k):
            raise CoreError(
                f"shape mismatch: x {tuple(x.shape)} should be ({n_tokens}, {n_embd}) and topk_w "
                f"{tuple(topk_w.shape)} should equal topk_ids {tuple(topk_ids.shape)}"
            )
        if out is None:
            y = torch.empty((n_tokens, n_embd), dtype=torch.float32)
        else:
            y = out
            if not (
                type(y) is torch.Tensor
                and y.dtype is torch.float32
                and y.layout is torch.strided
                and y.is_cpu
                and y.shape == (n_tokens, n_embd)
                and y.is_contiguous()
            ):
                raise CoreError(
                    f"out must be a contiguous float32 CPU tensor of shape ({n_tokens}, {n_embd}), "
                    f"got {_describe(y)}"
                )
            if _overlaps(y, x):
                raise CoreError("out must not share memory with x (y is written while x is read)")
        if n_tokens == 0:
            return None
        n_slots = n_expert
        map_ptr = _ffi.NULL
        if expert_map is not None:
            expert_map = _as_cpu(expert_map, torch.int32, "expert_map", 1)
            if expert_map.shape != (n_expert,):
                raise CoreError(
                    f"expert_map has shape {tuple(expert_map.shape)}, expected ({n_expert},): "
                    "one slot (or -1) per expert id"
                )
            expert_bytes = n_ff * 3 * row_bytes(fmt, n_embd)
            if expert_bytes == 0 or gud.nbytes % expert_bytes:
                raise CoreError(
                    f"expert weights hold {gud.nbytes} bytes, not a whole number of experts of "
                    f"{expert_bytes} bytes (n_ff={n_ff}, n_embd={n_embd}, format {fmt})"
                )
            n_slots = gud.nbytes // expert_bytes
            map_ptr = _ffi.cast(_P_CINT32, expert_map.data_ptr())
        contiguous = isinstance(gates, np.ndarray) and gates.flags.c_contiguous
        if gates is not None and not contiguous:
            raise CoreError("gates must be a C-contiguous numpy array (gates_apart's copy)")
        bias_gu = bias_down = _ffi.NULL
        gu_len = down_len = 0  # floats each bias holds (the C core checks them)
        gate_up = down = None
        if bias is not None:
            gate_up = _as_cpu(bias[0], torch.float32, "bias[0]", 3)
            down = _as_cpu(bias[1], torch.float32, "bias[1]", 2)
            if gate_up.shape != (n_slots, n_ff, 2) or down.shape != (n_slots, n_embd):
                raise CoreError(
                    f"expert biases have shapes {tuple(gate_up.shape)} and {tuple(down.shape)}, "
                    f"expected ({n_slots}, {n_ff}, 2) and ({n_slots}, {n_embd})"
                )
            bias_gu = _ffi.cast(_P_CFLOAT, gate_up.data_ptr())
            bias_down = _ffi.cast(_P_CFLOAT, down.data_ptr())
            gu_len, down_len = gate_up.numel(), down.numel()
        gud_buf = _ffi.from_buffer(gud)
        gates_buf = _ffi.NULL if gates is None else _ffi.from_buffer(gates)
        experts = _ffi.new(
            "pyrt_experts *",
            (
                gud_buf,
                gud.nbytes,
                fmt,
                n_expert,
                n_slots,
                n_ff,
                n_embd,
                map_ptr,
                bias_gu,
                gu_len,
                bias_down,
                down_len,
                float(swiglu[0]),
                float(swiglu[1]),
                gates_buf,
                0 if gates is None else gates.nbytes,
            ),
        )
        n_active = _ffi.new(_P_INT64)
        call_args = (
            self._pool,
            experts,
            _ffi.cast(_P_CFLOAT, x.data_ptr()),
            n_tokens,
            _ffi.cast(_P_CINT32, topk_ids.data_ptr()),
            _ffi.cast(_P_CFLOAT, topk_w.data_ptr()),
            k,
            ACTIVATIONS[activation],
            0.0 if threshold is None else float(threshold),
            _ffi.cast(_P_FLOAT, y.data_ptr()),
            n_active,
        )
        keep = (gud, gud_buf, x, topk_ids, topk_w, y, expert_map, gate_up, down, gates, gates_buf)
        return y, call_args, keep

    def linear(
        self,
        w: np.ndarray,
        fmt: int,
        n_out: int,
        n_in: int,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y = x w^T (+ bias): w [n_out, n_in] in format fmt, read in place (the mmap view).

        x: [T, n_in] float32 -> y [T, n_out] float32. For the blocked formats (Q8_0, Q4_0, Q5_0,
        Q5_1, the K-quants, MXFP4), x is quantized to Q8_0 blocks per token (as moe_ffn does);
        float formats use x as is.
        """
        if self._pool is None:
            raise CoreError("CpuCore is closed: create a new one")
        if not isinstance(w, np.ndarray) or not w.flags.c_contiguous:
            raise CoreError("weights must be a C-contiguous numpy array (the mmap view)")
        x = _as_cpu(x, torch.float32, "x", 2)
        if x.shape[1] != n_in:
            raise CoreError(f"shape mismatch: x {tuple(x.shape)} should be (T, {n_in})")
        if bias is not None:
            bias = _as_cpu(bias, torch.float32, "bias", 1)
            if bias.shape != (n_out,):
                raise CoreError(f"bias has shape {tuple(bias.shape)}, expected ({n_out},)")
        y = torch.empty((x.shape[0], n_out), dtype=torch.float32)
        if x.shape[0] == 0:
            return y
        m = _ffi.new("pyrt_matrix *", (_ffi.from_buffer(w), w.nbytes, fmt, n_out, n_in))
        _check(
            self._lib.pyrt_linear(
                self._pool,
                m,
                _ffi.cast(_P_CFLOAT, x.data_ptr()),
                x.shape[0],
                _ffi.NULL if bias is None else _ffi.cast(_P_CFLOAT, bias.data_ptr()),
                _ffi.cast(_P_FLOAT, y.data_ptr()),
            ),
            "pyrt_linear",
        )
        return y

    def linear_heads(
        self, w: np.ndarray, fmt: int, n_out: int, n_in: int, x: torch.Tensor
    ) -> torch.Tensor:
        """One matvec per head: w [n_out, n_in] (format fmt, read in place) is a stack of
        n_heads = x.shape[0] matrices of n_out / n_heads rows; x [n_heads, n_in] float32 ->
        y [n_heads, n_out / n_heads] float32, y[h] = w_h x[h] (pyrt_linear_heads)."""
        if self._pool is None:
            raise CoreError("CpuCore is closed: create a new one")
        if not isinstance(w, np.ndarray) or not w.flags.c_contiguous:
            raise CoreError("weights must be a C-contiguous numpy array (the mmap view)")
        x = _as_cpu(x, torch.float32, "x", 2)
        n_heads = x.shape[0]
        if x.shape[1] != n_in or n_heads < 1 or n_out % n_heads:
            raise CoreError(f"shape mismatch: x {tuple(x.shape)} for {n_out} rows of {n_in}")
        y = torch.empty((n_heads, n_out // n_heads), dtype=torch.float32)
        m = _ffi.new("pyrt_matrix *", (_ffi.from_buffer(w), w.nbytes, fmt, n_out, n_in))
        _check(
            self._lib.pyrt_linear_heads(
                self._pool,
                m,
                n_heads,
                _ffi.cast(_P_CFLOAT, x.data_ptr()),
                x.numel(),
                _ffi.cast(_P_FLOAT, y.data_ptr()),
                y.numel(),
            ),
            "pyrt_linear_heads",
        )
        return y

    def mem_read(self, buf: np.ndarray) -> int:
        """Read buf once on the pool's threads (DRAM read test); returns the checksum."""
        if self._pool is None:
            raise CoreError("CpuCore is closed: create a new one")
        checksum = _ffi.new("uint64_t *")
        data = _ffi.from_buffer(buf)
        _check(self._lib.pyrt_mem_read(self._pool, data, buf.nbytes, checksum), "pyrt_mem_read")
        return int(checksum[0])


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors' bytes overlap."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _describe(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    kind = "contiguous" if t.is_contiguous() else "non-contiguous"
    return f"a {kind} {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


def _as_cpu(t: torch.Tensor, dtype: torch.dtype, name: str, ndim: int) -> torch.Tensor:
    """t as a contiguous CPU tensor of dtype (a copy only when it is not one already)."""
    # the common case in a few attribute reads (t.device builds a torch.device: ~1 us)
    if (
        type(t) is torch.Tensor
        and t.dtype is dtype
        and t.is_cpu
        and t.dim() == ndim
        and t.is_contiguous()
    ):
        return t
    if not isinstance(t, torch.Tensor):
        raise CoreError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise CoreError(f"{name} is on {t.device}; the CPU core needs it on the CPU")
    if t.dim() != ndim:
        raise CoreError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        if t.dtype.is_floating_point != dtype.is_floating_point:
            raise CoreError(f"{name} has dtype {t.dtype}, expected {dtype}")
        t = t.to(dtype)
    return t.contiguous()
