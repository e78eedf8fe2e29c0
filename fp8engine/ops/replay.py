"""Record once, replay many: a step's ops as one straight-line Python function, without the Python around them.

Why: the fused FP8 layer step (:mod:`fp8engine.ops.layer`) issues the same ops, in the same order, with the same
non-tensor arguments, on every call of a given configuration (shapes, dtypes, recipe, options), and at small
shapes its time is the host's, about half of it the Python around the ops -- the wrappers' checks, the quantizer
and Float8Tensor objects, the choice of kernel (H100, ``[128, 1, 256]``, ``python tools/host_op_share.py@d6af129``:
the FP8 delayed step's top-level ATen ops and kernel launches take 2.69 of its 5.75 profiled ms, where the plain
PyTorch bf16 block's take 2.27 of 3.41 ms). A replay runs only the ops.

How:

1. :class:`Recorder` runs a call of the ordinary code as a ``torch.overrides.TorchFunctionMode`` and records each
   torch function and Tensor method called from Python (the outermost call only), and each Triton launch
   (:func:`fp8engine.kernels._common.launch`) and cuBLASLt call (:mod:`fp8engine.kernels.cublaslt`), which report
   themselves to the recorder (``kernels._common.RECORDER``). A tensor argument becomes a *slot*: one of the step's
   inputs, or the output of an earlier recorded op; every other argument is kept as a constant (shapes, dtypes,
   scalars, the compiled kernel).
2. :class:`Program` turns a recording into the source of one Python function (``Program.source``; print it to see
   what a step runs), e.g. ``s14 = c3(s2, 128, 768)`` for a torch op and
   ``c9(1, 1, 1, stream, c10, c11, None, None, None, s14.data_ptr(), ...)`` for a Triton kernel through its
   compiled launcher (as the direct path of ``launch`` calls it), and compiles it with ``exec``. Dead ops are
   dropped and each slot is released after its last use, as the ordinary code drops its intermediates. Rewrites
   cut dispatched ops without changing a byte: :func:`_fold_allocation_views`, :func:`_collapse_view_chains`,
   :func:`_skip_pointer_views`, a planned cuBLASLt GEMM called ``by_address``, and the pool of intermediate blocks
   (:func:`_plan_pool`).
3. A step split in two (an autograd forward and backward) records both (:class:`Pair`): the backward's recorder
   resolves tensors made in the forward to the forward's slots, and the forward program returns those (only those)
   for the backward program to take (:func:`_fold_saved_views`).

When a recording is sound, and when it is not (the recorder then gives up -- ``Recorder.error``, and
:class:`Program` raises :class:`RecordAbort` --, and the caller keeps the ordinary code for that configuration
from then on; nothing is replayed). What the recorder enforces, at record time (a replay runs no check):

- every tensor an op takes is an input or the output of an earlier recorded op. A tensor from anywhere else
  (a module attribute, a cache) aborts the recording: it would be frozen into the program;
- no recorded op output has a ``grad_fn`` (no autograd graph is built inside the step);
- no integer argument of a launch is a device pointer (it would be frozen);
- no call brings a tensor's value to the host, where the Python could branch on it or take a shape from it
  (``bool(t)``, ``t.item()``, ``int(t)``, ``lst[t]``, ``str(t)``, ``torch.equal`` ...: ``_HOST_READS``); no op
  makes a shape from values (``nonzero``, one-argument ``where``, ``repeat_interleave`` by a tensor, indexing by a
  boolean mask: ``_VALUE_SHAPED``); no slice has a tensor bound; and any other call that writes nothing and
  returns a Python value rather than a tensor aborts, unless it is a known query of what the key pins
  (``_QUERIES``: shape, strides, dtype, ``data_ptr`` ...), which only steers the Python and is not recorded; nor
  are conversions that return their argument itself (``x.contiguous()`` of a contiguous ``x``: ``_NO_COPY``).
  What runs inside a recorded call, a launch or a ``Recorder.call`` is not looked at: it runs again, whole;
- a call that writes into a tensor is recorded and kept, however it is called: by its ATen schema
  (:func:`_schema_writes`), an in-place method (``x.add_``, ``x[i] = v``, ``x += y``, ``x.data = y``), ``out=``,
  ``inplace=True``, a batch norm's running statistics; a call that returns one of its arguments and is not a
  known conversion (``F.relu(x, inplace=True)``), and one that returns None (made for its effect), are taken as
  writes too (a replay runs them again: never wrong, at worst one op more);
- the caller's key holds everything the Python of the step branches on: every input tensor's shape, strides,
  dtype, device, ``requires_grad`` and pointer alignment (:func:`tensor_key`; ``data_ptr() % 256``: Triton
  specialises kernels on 16-byte alignment and cuBLASLt picks algorithms by it), the non-tensor configuration, and
  the process state the ops dispatch on (``torch.autocast``, the backend switches of SDPA). Environment variables
  the kernels' Python reads (``FP8ENGINE_EMULATE_FP8_CVT`` ...) are taken as they were when the step was
  recorded. Intermediate tensors come from the caching allocator (512-byte aligned) or are views at fixed offsets
  of those, so their alignment is the recorded one. The key is the caller's to get right
  (:mod:`fp8engine.ops.layer`); what the recorder cannot see -- Python state read outside torch calls, such as a
  module attribute that is not a tensor -- is not checked (``FP8ENGINE_REPLAY=check`` is how to find such a miss).

The cache of programs by the caller's key and the check of a replay against the ordinary code
(``FP8ENGINE_REPLAY=check``) are in :mod:`fp8engine.ops.replay_cache`.

Streams and devices: a replayed launch reads the current CUDA stream at the time of the replay, as ``launch``
does. Under ``TRITON_INTERPRET=1`` launches are replayed through the interpreter (``kernel[grid](...)``).
"""
from __future__ import annotations

import functools
import math
import os
import weakref
from typing import Callable, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

from fp8engine.kernels import _common

__all__ = ["Recorder", "Program", "Pair", "RecordAbort", "tensor_key"]

#: Tensor methods that write into their first argument without ending in ``_`` (the augmented assignments, item
#: assignment, and property setters: ``t.data = ...``).
_MUTATING = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                       "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                       "__irshift__", "__set__"})
#: Ops that write an argument their ATen schema does not mark as written (the running statistics of a batch norm
#: in training).
_UNMARKED_WRITES = frozenset({"batch_norm", "native_batch_norm", "instance_norm", "_batch_norm_impl_index",
                              "cudnn_batch_norm", "miopen_batch_norm"})
#: Calls that bring a tensor's value to the host (a Python number, bool, string, list or array computed from the
#: elements): the Python after them may branch on it, which no key pins.
_HOST_READS = frozenset({"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "__complex__",
                         "__format__", "__repr__", "__str__", "__contains__", "__array__", "numpy", "is_nonzero",
                         "equal", "allclose", "_local_scalar_dense"})
#: Ops whose output shape depends on the input values (a recording would freeze the shape in the ops after them).
_VALUE_SHAPED = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "_unique",
                           "_unique2", "bincount"})
#: Calls that return no tensor and read only what the key pins (shape, strides, dtype, device, alignment; the
#: backend switches): they steer the Python the same way on every call of a configuration and are not recorded.
_QUERIES = frozenset({"__get__", "size", "stride", "dim", "ndimension", "numel", "nelement", "element_size",
                      "data_ptr", "storage_offset", "is_contiguous", "is_floating_point", "is_complex", "is_signed",
                      "is_inference", "is_pinned", "is_shared", "is_set_to", "is_same_size", "_is_view",
                      "get_device", "untyped_storage", "storage", "__len__", "__hash__", "type", "result_type",
                      "promote_types", "can_cast", "_fused_sdp_choice", "__dlpack_device__", "dim_order",
                      "has_names", "is_conj", "is_neg"})
#: Non-tensor results a call may return without reading a value (a query's metadata, a storage object).
_METADATA_TYPES = (torch.Size, torch.dtype, torch.device, torch.layout, torch.memory_format, torch.UntypedStorage,
                   torch.TypedStorage)
#: Calls that may return their argument itself without writing it (a conversion to what it already is): not
#: recorded (any other call that returns one of its arguments is recorded as a write).
_NO_COPY = frozenset({"contiguous", "to", "type", "type_as", "cpu", "cuda", "float", "double", "half", "bfloat16",
                      "int", "long", "short", "char", "byte", "bool", "flatten", "resolve_conj", "resolve_neg",
                      "conj"})
#: Largest int argument of a launch that is taken for a size, not a pointer (device pointers are far above it).
_POINTER_FLOOR = 1 << 40


class RecordAbort(Exception):
    """The recording cannot be replayed soundly (module docstring); the message says why."""


def _base_name(func) -> str:
    """``func``'s op name: ``add_`` for ``Tensor.add_``, ``torch.ops.aten.add_`` and ``torch.ops.aten.add_.Tensor``."""
    name = getattr(func, "__name__", "")
    return name.split(".")[0] if isinstance(func, torch._ops.OpOverload) else name


@functools.lru_cache(maxsize=1024)  # (a pure function of the op: its ATen schemas)
def _aten_schemas(func) -> tuple:
    """The ATen schemas a call of ``func`` (not an ``OpOverload``) may run: an ``OpOverloadPacket``'s overloads', or,
    for a torch function or Tensor method, those of the ATen op of its name (none for a Python-only name)."""
    packet = func
    if not isinstance(func, torch._ops.OpOverloadPacket):
        name = getattr(func, "__name__", "")
        if not name.isidentifier() or name.startswith("__"):
            return ()
        try:
            packet = getattr(torch.ops.aten, name)
        except (AttributeError, RuntimeError):
            return ()
    return tuple(getattr(packet, o)._schema for o in packet.overloads())


def _holds(schema_type, v) -> bool:
    """Whether ``v`` (an argument value) is a tensor, or tensors, where the schema takes them: a ``Tensor(a!)``
    (or optional) given a tensor, a ``Tensor(a!)[]`` given a list of them."""
    if isinstance(v, torch.Tensor):
        return "Tensor" in str(schema_type) and schema_type.kind() != "ListType"
    if type(v) in (list, tuple) and any(isinstance(t, torch.Tensor) for t in v):
        return schema_type.kind() == "ListType" and "Tensor" in str(schema_type)
    return False


def _schema_writes(func, args, kwargs) -> bool:
    """Whether the call may write into an argument, by its ATen schema: an ``OpOverload`` whose schema is mutable,
    or an op of which some overload writes (``Tensor(a!)``) an argument this call passes, as the type that
    overload takes (a packet's ``.out`` overload writes only where ``out=`` is given)."""
    if isinstance(func, torch._ops.OpOverload):
        return func._schema.is_mutable
    try:
        schemas = _aten_schemas(func)
    except TypeError:  # (an unhashable callable)
        schemas = _aten_schemas.__wrapped__(func)
    for schema in schemas:
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = args[i] if not a.kwarg_only and i < len(args) else kwargs.get(a.name)
            if _holds(a.type, v):
                return True
    return False


def _writes(func, name: str, args, kwargs) -> bool:
    """Whether a call writes into an argument (it is then recorded and kept, whatever it returns): by its schema
    (:func:`_schema_writes`), or, for calls no ATen schema describes, an in-place method (``x.add_``,
    ``x[i] = v``, ``x += y``), an ``out=`` tensor, ``inplace=True``, a batch norm (``_UNMARKED_WRITES``)."""
    if not isinstance(func, torch._ops.OpOverload) and (
            name in _MUTATING or (name.endswith("_") and not name.endswith("__"))):
        return True
    if name in _UNMARKED_WRITES or _tensors_in(kwargs.get("out")) or kwargs.get("inplace") is True:
        return True
    return _schema_writes(func, args, kwargs)


def _host_read(name: str, args, kwargs) -> Optional[str]:
    """Why the call brings a tensor's value to the host, where the Python after it may branch on it or take a
    shape from it, or None: it does not (module docstring, "When a recording is sound")."""
    if name in _HOST_READS:
        return f"{name}() reads a tensor's value on the host"
    if name in _VALUE_SHAPED or (name == "where" and len(args) + len(kwargs) == 1):
        return f"{name}() makes a tensor whose shape depends on its input's values"
    if name == "repeat_interleave" and "output_size" not in kwargs and (
            isinstance(kwargs.get("repeats", args[1] if len(args) > 1 else args[0] if args else None),
                       torch.Tensor)):
        return "repeat_interleave() by a tensor of repeats makes a tensor whose shape depends on its values"
    index = args[1] if len(args) > 1 and name in ("__getitem__", "index") else None
    for v in (index if type(index) in (tuple, list) else (index,)):
        if isinstance(v, torch.Tensor) and v.dtype in (torch.bool, torch.uint8):
            return "indexing by a boolean mask makes a tensor whose shape depends on the mask's values"
    if _slice_tensor(args) or _slice_tensor(tuple(kwargs.values())):
        return "a slice bound is a tensor (its value sets a shape)"
    return None


def _slice_tensor(v) -> bool:
    """Whether ``v`` (arguments, nested in tuples / lists) holds a slice with a tensor bound."""
    if type(v) is slice:
        return any(isinstance(b, torch.Tensor) for b in (v.start, v.stop, v.step))
    if type(v) in (list, tuple):
        return any(_slice_tensor(a) for a in v)
    return False


def tensor_key(t: Optional[torch.Tensor]):
    """What a step's Python can branch on about an input tensor (module docstring), or None for None."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.data_ptr() & 255 if t.is_cuda else None


class _Ref:
    """A slot in an op's argument template."""

    __slots__ = ("slot",)

    def __init__(self, slot: int):
        self.slot = slot


class _Op:
    """One recorded call: ``kind`` ``"call"`` (``fn(*args, **kwargs)``) or ``"launch"`` (a Triton kernel through
    its compiled launcher, ``entry`` as ``kernels._common.launch_entry`` returns it; None: through
    ``_common.launch_now``). ``outs``: for a tensor result its new slot; for a tuple / list one entry per element (a
    new slot, or None: not a tensor or already known); None: the result is not kept. ``pinned``: kept even when no
    later op reads its outputs (it writes into an argument, or is a launch)."""

    __slots__ = ("kind", "fn", "args", "kwargs", "outs", "pinned", "entry", "grid", "meta", "alias_of", "layout",
                 "view_of", "rel", "views")

    def __init__(self, kind, fn, args, kwargs, outs, pinned, entry=None, grid=None, meta=None, alias_of=None,
                 layout=None, view_of=None, rel=0, views=False):
        self.kind, self.fn, self.args, self.kwargs, self.outs, self.pinned = kind, fn, args, kwargs, outs, pinned
        self.entry, self.grid, self.meta = entry, grid, meta
        self.alias_of = alias_of  # the slot whose address the (single) output has, for a view of it
        # (shape, strides, dtype, device) of the output: for an allocation (``torch.empty``) and a view
        self.layout = layout
        # for a view of its first argument (same storage, same dtype): that argument's slot, and the output's
        # storage offset minus the argument's (elements)
        self.view_of, self.rel = view_of, rel
        self.views = views  # some new output shares memory with an argument (a view, a split ...)

    def out_slots(self) -> list:
        if self.outs is None:
            return []
        if isinstance(self.outs, int):
            return [self.outs]
        return [s for s in self.outs if s is not None]

    def refs(self) -> list:
        found: list = []
        _collect((self.args, self.kwargs), found)
        return found


class _Offset:
    """An argument ``slot.storage_offset() + rel`` (a view re-based on its chain's root, ``as_strided``)."""

    __slots__ = ("slot", "rel")

    def __init__(self, slot: int, rel: int):
        self.slot, self.rel = slot, rel


def _collect(v, found: list) -> None:
    if isinstance(v, (_Ref, _Offset)):
        found.append(v.slot)
    elif type(v) in (list, tuple):
        for a in v:
            _collect(a, found)
    elif type(v) is dict:
        for a in v.values():
            _collect(a, found)


def _tensors_in(v) -> list:
    if isinstance(v, torch.Tensor):
        return [v]
    if type(v) in (list, tuple):
        return [t for a in v for t in _tensors_in(a)]
    return []


class Recorder(TorchFunctionMode):
    """Records the ops of one call of ordinary code (module docstring, step 1).

    Args:
        inputs: the call's input tensors (None entries allowed), slots ``0 .. len(inputs) - 1``.
        outer: the recorder of the forward this call is the backward of (its tensors become the program's
            ``outer`` arguments), or None.
    Use as a context manager around the call; then :meth:`slot_of` the outputs and build a :class:`Program`.
    ``error`` holds why the recording is not sound (None: it is).
    """

    def __init__(self, inputs: Sequence[Optional[torch.Tensor]], outer: Optional["Recorder"] = None):
        super().__init__()
        self.ops: list[_Op] = []
        self._ids: dict = {}  # id(tensor) -> (weakref to it, slot); weak: the recording keeps nothing alive
        self.n_slots = 0
        self.input_slots = [self._new(t) if t is not None else None for t in inputs]
        self.outer = outer
        self.outer_refs: list[tuple[int, int]] = []  # (slot in the outer recording, slot here)
        self.error: Optional[str] = None
        self._paused = 0
        self._token = None

    # -- slots -----------------------------------------------------------------------------------------------
    def _new(self, t: torch.Tensor) -> int:
        slot = self.n_slots
        self.n_slots += 1
        self._ids[id(t)] = (weakref.ref(t), slot)
        return slot

    def _known(self, t: torch.Tensor) -> Optional[int]:
        entry = self._ids.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def slot_of(self, t: torch.Tensor) -> int:
        """The slot of a tensor the recorded code took or made; :class:`RecordAbort` for any other."""
        slot = self._known(t)
        if slot is not None:
            return slot
        if self.outer is not None:
            outer_slot = self.outer._known(t)
            if outer_slot is not None:
                slot = self._new(t)
                self.outer_refs.append((outer_slot, slot))
                return slot
        raise RecordAbort(f"a tensor {tuple(t.shape)} {t.dtype} that is neither an input nor made by a recorded op")

    def template(self, v):
        """``v`` with each tensor replaced by its slot (nested tuples / lists too): what :class:`Program` takes
        for its outputs. :class:`RecordAbort` for a tensor the recording does not know, or when the recording
        gave up (``error``)."""
        if self.error is not None:
            raise RecordAbort(self.error)
        if isinstance(v, torch.Tensor):
            return _Ref(self.slot_of(v))
        if type(v) in (list, tuple):
            return type(v)(self.template(a) for a in v)
        return v

    def _outputs(self, out):
        """New slots for the tensors of a result (known tensors -- written in place, or aliases -- keep theirs)."""
        def one(t):
            if not isinstance(t, torch.Tensor):
                return None
            if t.grad_fn is not None:  # (a view of a parameter made under no_grad requires grad, with no grad_fn)
                raise RecordAbort("an op inside the step built an autograd graph")
            return None if self._known(t) is not None else self._new(t)
        if isinstance(out, torch.Tensor):
            return one(out)
        if type(out) in (list, tuple):
            return [one(t) for t in out]
        return None

    # -- recording ---------------------------------------------------------------------------------------------
    def __enter__(self):
        self._token = _common.RECORDER.set(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _common.RECORDER.reset(self._token)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._paused or self.error is not None:
            return out
        try:
            self._record_call(func, args, kwargs, out)
        except RecordAbort as err:
            self.error = str(err)
        return out

    def _record_call(self, func, args, kwargs, out) -> None:
        name = _base_name(func)
        why = _host_read(name, args, kwargs)
        if why is not None:
            raise RecordAbort(why)
        mutates = _writes(func, name, args, kwargs)
        results = _tensors_in(out)
        if not mutates:
            if out is None and name not in _QUERIES:
                mutates = True  # a call made for its effect (record_stream ...): replayed as it was made
            elif not results:
                if name not in _QUERIES and not isinstance(out, _METADATA_TYPES):  # (a number, bool, list ...)
                    raise RecordAbort(f"{name}() returned a {type(out).__name__}, which may hold a tensor's value")
                return  # a query (shape, data_ptr, is_contiguous ...): it only steered the Python
            elif all(any(r is a for a in _tensors_in((args, tuple(kwargs.values())))) for r in results):
                if name in _NO_COPY:
                    return  # returned an argument itself (contiguous(), to() of the same dtype)
                mutates = True  # returned an argument itself: it may have written it (F.relu(inplace=True))
        targs = self.template(args)
        tkwargs = {k: self.template(v) for k, v in kwargs.items()}
        alias_of = layout = view_of = None
        rel = 0
        if not mutates and isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
            if out.data_ptr() == args[0].data_ptr():
                alias_of = targs[0].slot  # a view at its argument's address (the argument is alive: not a new block)
            if (out._is_view() and out.dtype == args[0].dtype
                    and out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()):
                view_of, rel = targs[0].slot, out.storage_offset() - args[0].storage_offset()
        if isinstance(out, torch.Tensor) and (alias_of is not None or view_of is not None or (
                func in (torch.empty, torch.empty_strided, torch.empty_like) and set(kwargs) <= {"dtype", "device"})):
            layout = (tuple(out.shape), tuple(out.stride()), out.dtype, out.device)
        views = any(r._is_view() for r in results)  # (a known result -- written in place -- makes no slot)
        self.ops.append(_Op("call", func, targs, tkwargs, self._outputs(out), mutates, alias_of=alias_of,
                            layout=layout, view_of=view_of, rel=rel, views=views))

    def call(self, fn: Callable, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` -- a call that does not go through torch functions, such as a cuBLASLt
        launch -- unrecorded inside, and record it as one op (its result is not kept)."""
        self._paused += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            self._paused -= 1
        if self.error is None and not self._paused:
            try:
                self.ops.append(_Op("call", fn, self.template(args),
                                    {k: self.template(v) for k, v in kwargs.items()}, None, True))
            except RecordAbort as err:
                self.error = str(err)
        return out

    def launch(self, kernel, grid: tuple, args: tuple, meta: dict) -> None:
        """Launch a Triton kernel (``_common.launch_now``) and record it with its compiled launcher."""
        self._paused += 1
        try:
            _common.launch_now(kernel, grid, args, meta)
        finally:
            self._paused -= 1
        if self.error is not None or self._paused:
            return
        try:
            if any(type(a) is int and abs(a) >= _POINTER_FLOOR for a in args):
                raise RecordAbort("a launch took an integer that may be a device pointer")
            entry = _common.launch_entry(kernel, args, meta)
            self.ops.append(_Op("launch", kernel, self.template(args), {}, None, True, entry, tuple(grid), meta))
        except RecordAbort as err:
            self.error = str(err)


class Program:
    """A recording as one compiled Python function (module docstring, step 2).

    Args:
        rec: a sound :class:`Recorder` (``rec.error`` None).
        outputs: what the function returns, as ``rec.template(...)`` gave it for a structure (tuple / list,
            nested) of tensors the recorded code made or took, and constants (None).
        keep: more slots to return (as a second result, a list), for a later program (:class:`Pair`).
        keep_mode: for slots of ``keep``, how the later program reads them (:class:`Pair`): ``"address"`` (only
            their addresses: a pooled one may be returned as its address, an int) or ``"alias"`` (it makes views
            of them that may leave it: not pooled); others: as tensors.
        int_outer: slots of ``rec``'s ``outer`` arguments that arrive as addresses (ints), and ``extra_outer``
            more ``outer`` arguments after them (the pooled blocks those addresses point into, held until the
            program returns).
    ``program(inputs, outer)`` -> ``(outputs, kept)``: ``inputs`` in the recorder's input order, ``outer`` a list
    of the values of ``rec.outer_refs``' outer slots, in that order (then ``extra_outer`` blocks), which the
    program empties (so each of those tensors is released after its last use here, as the ordinary backward drops
    the forward's tensors as it goes); ``kept`` a list: ``keep``'s values (``int_kept``: those returned as
    addresses), then ``kept_blocks`` pooled blocks (:func:`_plan_pool`).
    """

    def __init__(self, rec: Recorder, outputs, keep: Sequence[int] = (), keep_mode: Optional[dict] = None,
                 int_outer: frozenset = frozenset(), extra_outer: int = 0):
        if rec.error is not None:
            raise RecordAbort(rec.error)
        pinned_out = _pinned_slots(outputs, keep)
        ops = _live_ops(rec.ops, pinned_out)
        if _fold_allocation_views(ops, pinned_out) | _collapse_view_chains(ops, pinned_out):
            ops = _live_ops(ops, pinned_out)
        pool = _plan_pool(ops, _pinned_slots(outputs, ()), keep, keep_mode or {}) if POOL else _PoolPlan()
        self._pool, self._int = pool, set(int_outer)
        last: dict = {}
        for i, op in enumerate(ops):
            for s in op.refs():
                last[s] = i
        self._consts: dict = {}
        lines = ["def program(inputs, outer):"]
        names = ", ".join("_" if s is None else f"s{s}" for s in rec.input_slots)
        if rec.input_slots:
            lines.append(f"    {names}{',' if len(rec.input_slots) == 1 else ''} = inputs")
        outer_names = [f"s{s}" for _, s in rec.outer_refs] + [f"_o{i}" for i in range(extra_outer)]
        if outer_names:  # (then emptied: each of its tensors is released here after its last use)
            lines.append(f"    {', '.join(outer_names)}{',' if len(outer_names) == 1 else ''} = outer")
            lines.append("    outer.clear()")
        if any(op.kind == "launch" and op.entry is not None for op in ops):
            lines.append(f"    stream = {self._const(_common.current_stream)}()")
        for k, (device, nbytes, dtypes) in enumerate(pool.blocks):
            lines.append(f"    _a{k} = {self._const(torch.empty)}({nbytes}, dtype={self._const(torch.uint8)}, "
                         f"device={self._const(device)})")
            lines.append(f"    _p{k} = _a{k}.data_ptr()")
            for j, dt in enumerate(dtypes):
                lines.append(f"    _a{k}_{j} = _a{k}.view({self._const(dt)})")
        for i, op in enumerate(ops):
            if id(op) in pool.dropped:
                slot = op.outs
                if slot in pool.tensor:
                    k, off, (shape, stride, dt, _) = pool.slots[slot]
                    j = pool.blocks[k][2].index(dt)
                    lines.append(f"    s{slot} = {self._const(torch.as_strided)}(_a{k}_{j}, {shape!r}, {stride!r}, "
                                 f"{off // dt.itemsize})")
            else:
                lines.extend(self._lines(op, last, pinned_out))
            dead = [s for s in op.refs() if last.get(s) == i and s not in pinned_out
                    and (s not in pool.slots or s in pool.tensor)]
            if dead:
                lines.append(f"    {' = '.join(f's{s}' for s in sorted(set(dead)))} = None")
        kept = [self._address(s) if s in pool.int_kept else f"s{s}" for s in keep]
        kept += [f"_a{k}" for k in pool.kept_blocks]
        lines.append(f"    return {self._render(outputs)}, [{', '.join(kept)}]")
        self.source = "\n".join(lines)
        scope: dict = {}
        exec(compile(self.source, "<fp8engine replay>", "exec"), self._consts, scope)
        self._fn = scope["program"]
        self.n_ops = len(ops) - len(pool.dropped)
        self.int_kept = frozenset(pool.int_kept)
        self.kept_blocks = len(pool.kept_blocks)
        self.pooled = len(pool.slots)

    def __call__(self, inputs: Sequence, outer: Sequence = ()):
        return self._fn(inputs, outer)

    # -- code generation ----------------------------------------------------------------------------------------
    def _const(self, value) -> str:
        name = f"c{len(self._consts)}"
        self._consts[name] = value
        return name

    def _address(self, slot: int) -> str:
        """The source of slot's address: an int argument, the pool's address plus the offset, or ``data_ptr()``."""
        if slot in self._int:
            return f"s{slot}"
        hit = self._pool.slots.get(slot)
        if hit is not None:
            k, off = hit[0], hit[1]
            return f"(_p{k} + {off})" if off else f"_p{k}"
        return f"s{slot}.data_ptr()"

    def _render(self, v, ptr: bool = False) -> str:
        if isinstance(v, _Ref):
            return self._address(v.slot) if ptr else f"s{v.slot}"
        if isinstance(v, _Offset):
            return f"s{v.slot}.storage_offset() + {v.rel}"
        if v is None or type(v) in (bool, int, str) or (type(v) is float and math.isfinite(v)):
            return repr(v)
        if type(v) is tuple:
            inner = ", ".join(self._render(a, ptr) for a in v)
            return f"({inner}{',' if len(v) == 1 else ''})"
        if type(v) is list:
            return "[" + ", ".join(self._render(a, ptr) for a in v) + "]"
        return self._const(v)

    def _lines(self, op: _Op, last: dict, pinned: set) -> list:
        if op.kind == "launch":
            if op.entry is not None:  # the compiled launcher, as launch()'s direct path calls it
                run, function, packed, tail = op.entry
                grid = tuple(op.grid) + (1,) * (3 - len(op.grid))
                args = [self._render(a, ptr=True) for a in op.args]
                call = (f"{self._const(run)}({', '.join(map(repr, grid))}, stream, {self._const(function)}, "
                        f"{self._const(packed)}, None, None, None, {', '.join(args)}"
                        f"{', *' + self._const(tuple(tail)) if tail else ''})")
            else:
                call = (f"{self._const(_common.launch_now)}({self._const(op.fn)}, {self._render(op.grid)}, "
                        f"{self._render(tuple(op.args))}, {self._const(dict(op.meta))})")
            return [f"    {call}"]
        ptr = _address_reader(op)
        args = [self._render(a, ptr) for a in op.args] + [f"{k}={self._render(v, ptr)}" for k, v in op.kwargs.items()]
        if ptr:  # (its result is not kept: Recorder.call)
            return [f"    {self._const(op.fn.by_address)}({', '.join(args)})"]
        call = f"{self._const(op.fn)}({', '.join(args)})"
        used = lambda s: s is not None and (s in last or s in pinned)  # noqa: E731
        if isinstance(op.outs, int):
            return [f"    s{op.outs} = {call}" if used(op.outs) else f"    {call}"]
        if op.outs is not None and any(used(s) for s in op.outs):
            out = [f"    _r = {call}"]
            out += [f"    s{s} = _r[{i}]" for i, s in enumerate(op.outs) if used(s)]
            return out
        return [f"    {call}"]


#: Pool a program's small intermediate blocks (:func:`_plan_pool`); ``FP8ENGINE_REPLAY_POOL=0`` (read at import)
#: turns it off for programs built afterwards.
POOL = os.environ.get("FP8ENGINE_REPLAY_POOL", "1") != "0"
#: A program whose poolable blocks add up to at most this many bytes has them all pooled; a larger one only its
#: blocks of at most ``POOL_SMALL_BYTES`` (scale inverses, row statistics, partial sums).
POOL_ALL_BYTES = 8 << 20
POOL_SMALL_BYTES = 64 << 10
#: Offset granularity inside a pool: every pooled block keeps a 256-byte aligned address (the alignment the
#: Triton kernels specialise on and the cuBLASLt plans are keyed by, as a fresh block from the caching allocator).
_POOL_ALIGN = 256


class _PoolPlan:
    """Where :func:`_plan_pool` puts a program's pooled blocks.

    ``slots``: slot -> (pool index, byte offset, layout) for each pooled block and each view of one (a view's
    offset is its first element's); ``tensor``: the pooled slots made as tensors (``torch.as_strided`` of the pool);
    ``dropped``: ids of the ops the pool replaces (the allocations and those views); ``blocks``: per pool
    ``(device, bytes, dtypes of its tensor views)``; ``int_kept``: kept slots returned as their address;
    ``kept_blocks``: pools returned with the kept slots (int addresses into them need them alive)."""

    def __init__(self):
        self.slots: dict = {}
        self.tensor: set = set()
        self.dropped: set = set()
        self.blocks: list = []
        self.int_kept: set = set()
        self.kept_blocks: list = []


def _alloc_bytes(op: _Op) -> Optional[int]:
    """The bytes of a block ``op`` allocates (``torch.empty`` / ``empty_strided`` / ``empty_like`` of a recorded
    dense layout), or None: not such an allocation."""
    if (op.kind != "call" or op.fn not in (torch.empty, torch.empty_strided, torch.empty_like) or op.layout is None
            or not isinstance(op.outs, int) or not _dense(op.layout)):
        return None
    return math.prod(op.layout[0]) * op.layout[2].itemsize


def _sharing(ops: list, slots) -> set:
    """The slots whose memory may be shared with one of ``slots`` (theirs included), through every op of ``ops``
    that makes views."""
    roots: dict = {}  # slot -> the slots whose memory it may share (itself included)
    for op in ops:
        if op.kind == "call" and (op.views or op.alias_of is not None or op.view_of is not None):
            src = set().union(*(roots.get(s, {s}) for s in op.refs()))
            for s in op.out_slots():
                roots[s] = src | {s}
    return set().union(*(roots.get(s, {s}) for s in slots))


def _plan_pool(ops: list, outputs: set, keep: Sequence[int], keep_mode: dict) -> _PoolPlan:
    """Pool the program's intermediate allocations: one block per device holds them at 256-byte aligned offsets,
    allocated when the program starts; a pooled block only address readers (:func:`_address_reader`) read is never
    made as a tensor (its address is the pool's plus its offset), the others are ``torch.as_strided`` views of it.

    Why: each ``torch.empty`` costs the host ~4-8 us (and its release ~1-2 us), about as much as the launch that
    fills the block; a small FP8 layer step allocates ~60 blocks (``python tools/replay_lines.py``).
    Which: allocations of a recorded dense layout that no output of the program shares memory with (an output
    leaves the step: a gradient must not hold the pool), all of them where they add up to ``POOL_ALL_BYTES``,
    else those of at most ``POOL_SMALL_BYTES``; a kept one (for the backward) only where the backward makes no
    view of it (``keep_mode``). Memory: a pooled block lives until the last tensor made from the pool dies (the
    backward's end for a pool holding kept blocks), so a step holds at most ``POOL_ALL_BYTES`` per pool longer than
    the ordinary step would, and a large step only its small blocks."""
    plan = _PoolPlan()
    escaping = _sharing(ops, [*outputs, *(s for s in keep if keep_mode.get(s) == "alias")])
    cands = [(op, n) for op in ops if (n := _alloc_bytes(op)) is not None and n > 0 and op.outs not in escaping]
    if not cands:
        return plan
    if sum(n for _, n in cands) > POOL_ALL_BYTES:
        cands = [(op, n) for op, n in cands if n <= POOL_SMALL_BYTES]
    # offsets, one pool per device
    pools: dict = {}  # device -> [index, bytes]
    for op, n in cands:
        device = op.layout[3]
        entry = pools.setdefault(device, [len(pools), 0])
        off = -(-entry[1] // _POOL_ALIGN) * _POOL_ALIGN
        if off + n > POOL_ALL_BYTES:
            continue  # (a pool holds at most POOL_ALL_BYTES)
        plan.slots[op.outs] = (entry[0], off, op.layout)
        plan.dropped.add(id(op))
        entry[1] = off + n
    # views of a pooled block are pooled slots too (no op): same pool, their own offset and layout
    for op in ops:
        base = plan.slots.get(op.view_of) if op.kind == "call" else None
        if (base is not None and isinstance(op.outs, int) and op.layout is not None and op.rel >= 0
                and op.outs not in escaping):
            plan.slots[op.outs] = (base[0], base[1] + op.rel * op.layout[2].itemsize, op.layout)
            plan.dropped.add(id(op))
    # a pooled slot read as a tensor (by any op but an address reader or a dropped view) is made as one
    for op in ops:
        if id(op) not in plan.dropped and not _address_reader(op):
            plan.tensor.update(s for s in op.refs() if s in plan.slots)
    for s in keep:
        if s in plan.slots:
            if keep_mode.get(s) == "address" and s not in plan.tensor:
                plan.int_kept.add(s)
            else:
                plan.tensor.add(s)
    dtypes: dict = {}
    for s in plan.tensor:
        k, _, layout = plan.slots[s]
        if layout[2] not in dtypes.setdefault(k, []):
            dtypes[k].append(layout[2])
    plan.blocks = [(device, max(-(-nbytes // _POOL_ALIGN) * _POOL_ALIGN, _POOL_ALIGN), dtypes.get(k, []))
                   for device, (k, nbytes) in pools.items()]  # (k: the pool's index, in insertion order)
    plan.kept_blocks = sorted({plan.slots[s][0] for s in plan.int_kept})
    return plan


def _pinned_slots(outputs, keep: Sequence[int]) -> set:
    """The slots a program returns (its outputs and ``keep``)."""
    _collect(outputs, found := [])
    return set(found) | set(keep)


def _live_ops(ops: list, pinned: set) -> list:
    """``ops`` without views made only for a launch's address (:func:`_skip_pointer_views`), without the ops folded
    into an allocation (:func:`_fold_allocation_views`), and without dead ops: nothing later reads what they make,
    and they write nothing."""
    _skip_pointer_views(ops, pinned)
    live = set(pinned)
    kept = []
    for op in reversed(ops):
        if op.kind != "folded" and (op.pinned or any(s in live for s in op.out_slots())):
            kept.append(op)
            live.update(op.refs())
    kept.reverse()
    return kept


def _readers(ops: list) -> dict:
    """slot -> the ops that read it (once per op)."""
    readers: dict = {}
    for op in ops:
        for s in set(op.refs()):
            readers.setdefault(s, []).append(op)
    return readers


def _dense(layout) -> bool:
    """Whether a layout's elements fill exactly its numel consecutive elements (any order): a transpose, a
    permutation or a reshape of a fresh block, not a slice of it."""
    shape, stride = layout[0], layout[1]
    numel = math.prod(shape)
    span = 1 + sum((n - 1) * st for n, st in zip(shape, stride))
    return numel > 0 and all(st > 0 for st in stride) and span == numel


def _foldable_view(view: _Op, alloc: _Op) -> bool:
    """Whether ``view`` (an op whose one output is a view at its first argument's address) can be allocated as
    it is in place of the block ``alloc`` allocates (``torch.empty``): same dtype, same elements (dense, same
    numel)."""
    return (view.kind == "call" and view.layout is not None and isinstance(view.outs, int)
            and alloc.kind == "call" and alloc.fn is torch.empty and alloc.layout is not None
            and isinstance(alloc.outs, int) and view.layout[2:] == alloc.layout[2:] and _dense(view.layout)
            and math.prod(view.layout[0]) == math.prod(alloc.layout[0]))


def _allocate_as(alloc: _Op, layout) -> None:
    """Turn an allocation op into ``torch.empty_strided`` of ``layout`` (the same bytes: a dense layout of the
    same numel)."""
    shape, stride, dtype, device = layout
    alloc.fn, alloc.args, alloc.kwargs = torch.empty_strided, (shape, stride), {"dtype": dtype, "device": device}
    alloc.layout = layout


def _rename(ops: list, old: int, new: int) -> None:
    """Make every op that reads slot ``old`` read ``new``."""
    def sub(v):
        if isinstance(v, _Ref):
            return _Ref(new) if v.slot == old else v
        if isinstance(v, _Offset):
            return _Offset(new, v.rel) if v.slot == old else v
        if type(v) in (list, tuple):
            return type(v)(sub(a) for a in v)
        if type(v) is dict:
            return {k: sub(a) for k, a in v.items()}
        return v
    for op in ops:
        op.args, op.kwargs = sub(op.args), sub(op.kwargs)


def _address_reader(op: _Op) -> bool:
    """Whether ``op`` reads its tensors only for their addresses: a launch through the compiled launcher, or a
    call of an object with a ``by_address`` method (a planned cuBLASLt GEMM, :class:`fp8engine.kernels.cublaslt._Site`)
    that the program calls with the addresses instead."""
    return (op.entry is not None if op.kind == "launch"
            else op.kind == "call" and getattr(op.fn, "by_address", None) is not None)


def _fold_allocation_views(ops: list, pinned: set) -> bool:
    """Allocate a block directly in the layout of the one view the step takes of it (``torch.empty`` then
    ``.t()`` / ``.reshape(...)`` becomes one ``torch.empty_strided``), where the block is otherwise only written
    by launches (which take its address: the view's) and not returned: one dispatched op fewer, the same bytes at
    the same address. Returns whether anything was folded."""
    readers = _readers(ops)
    producer = {op.outs: op for op in ops if op.kind == "call" and isinstance(op.outs, int)}
    folded = False
    for view in ops:
        alloc = producer.get(view.alias_of) if view.kind == "call" else None
        if alloc is None or alloc.outs in pinned or not _foldable_view(view, alloc):  # (alias_of: its address)
            continue
        others = [r for r in readers.get(alloc.outs, []) if r is not view]
        if not all(map(_address_reader, others)):
            continue
        _allocate_as(alloc, view.layout)
        _rename(others, alloc.outs, view.outs)
        alloc.outs = view.outs
        view.kind = "folded"
        folded = True
    return folded


def _collapse_view_chains(ops: list, pinned: set) -> bool:
    """Make each view of a view (``qkv.view(...)[..., 0, :].reshape(...).permute(...)``: a chain whose links nothing
    else reads) one ``torch.as_strided`` of the chain's root, with the recorded sizes and strides and the storage
    offset relative to the root's (views are functions of their argument's layout, which the key pins): one
    dispatched op per chain instead of one per link. Returns whether anything changed."""
    readers = _readers(ops)
    root: dict = {}  # view slot -> (root slot, storage offset relative to the root)
    changed = False
    for op in ops:
        if op.kind != "call" or op.view_of is None or not isinstance(op.outs, int) or op.layout is None:
            continue
        src = op.view_of
        base, off = root.get(src, (src, 0))
        off += op.rel
        root[op.outs] = (base, off)
        if (src in root and src not in pinned
                and all(r.kind == "call" and r.view_of == src for r in readers.get(src, []))):
            op.fn, op.args, op.kwargs = torch.as_strided, (_Ref(base), *op.layout[:2], _Offset(base, off)), {}
            op.view_of, op.rel, op.alias_of = base, off, base if off == 0 else None
            changed = True
    return changed


def _fold_saved_views(fwd: Recorder, fwd_outputs: set, keep: Sequence[int], bwd: Recorder,
                      bwd_pinned: set) -> None:
    """:func:`_fold_allocation_views` across a forward and its backward: a block the forward allocates and only
    launches write, kept for the backward (``keep``; not one of the forward's outputs), whose one use there is one
    view of it (the transposed FP8 copies saved for the GEMMs, which take them as ``.t()``), is allocated in that
    view's layout by the forward, and the backward reads it as it is."""
    fwd_ops, bwd_ops = _live_ops(fwd.ops, fwd_outputs | set(keep)), _live_ops(bwd.ops, bwd_pinned)
    fwd_readers, bwd_readers = _readers(fwd_ops), _readers(bwd_ops)
    producer = {op.outs: op for op in fwd_ops if op.kind == "call" and isinstance(op.outs, int)}
    for outer, slot in bwd.outer_refs:
        alloc, users = producer.get(outer), bwd_readers.get(slot, [])
        if alloc is None or outer in fwd_outputs or len(users) != 1:
            continue
        view = users[0]
        if (view.alias_of != slot or view.outs in bwd_pinned or not _foldable_view(view, alloc)
                or not all(map(_address_reader, fwd_readers.get(outer, [])))):
            continue
        _allocate_as(alloc, view.layout)
        _rename(bwd_ops, view.outs, slot)
        view.kind = "folded"


def _skip_pointer_views(ops: list, pinned: set) -> None:
    """A view whose only readers are launches through the compiled launcher -- which take its address, equal to
    its source's, with the layout in their other arguments (``x.view(torch.uint8)`` of an FP8 buffer, a 2-D
    ``reshape``) -- is not made: those launches take the source's address (the view op is then dead)."""
    ops = [op for op in ops if op.kind != "folded"]  # (a folded view is no op: its slot is its allocation's)
    readers: dict = {}  # slot -> [reads it only for its address, ...]
    for op in ops:
        address = _address_reader(op)
        for s in op.refs():
            readers.setdefault(s, []).append(address)
    source: dict = {}
    for op in ops:
        if (op.alias_of is not None and isinstance(op.outs, int) and op.outs not in pinned
                and all(readers.get(op.outs, [False]))):
            source[op.outs] = source.get(op.alias_of, op.alias_of)
    if source:
        for op in ops:
            if _address_reader(op):
                op.args = tuple(_Ref(source.get(a.slot, a.slot)) if isinstance(a, _Ref) else a for a in op.args)


class Pair:
    """A forward and its backward, recorded on one call (module docstring, step 3).

    ``forward(inputs)`` -> ``(outputs, saved)``; ``backward(inputs, saved)`` -> its outputs. ``saved`` (a list)
    holds exactly the forward tensors the backward reads; the backward empties it.
    """

    def __init__(self, fwd: Recorder, fwd_outputs, bwd: Recorder, bwd_outputs):
        if fwd.error is not None or bwd.error is not None:
            raise RecordAbort(fwd.error or bwd.error)
        keep = [outer for outer, _ in bwd.outer_refs]  # the forward slots the backward reads
        bwd_pinned = _pinned_slots(bwd_outputs, ())
        _fold_saved_views(fwd, _pinned_slots(fwd_outputs, ()), keep, bwd, bwd_pinned)
        # how the backward reads each kept slot (Program's keep_mode)
        bwd_ops = _live_ops(bwd.ops, bwd_pinned)
        readers, escaping = _readers(bwd_ops), _sharing(bwd_ops, bwd_pinned)
        mode = {}
        for outer, slot in bwd.outer_refs:
            if slot in escaping:
                mode[outer] = "alias"
            elif readers.get(slot) and all(map(_address_reader, readers[slot])):
                mode[outer] = "address"
        self.fwd = Program(fwd, fwd_outputs, keep=keep, keep_mode=mode)
        int_outer = frozenset(slot for outer, slot in bwd.outer_refs if outer in self.fwd.int_kept)
        self.bwd = Program(bwd, bwd_outputs, int_outer=int_outer, extra_outer=self.fwd.kept_blocks)

    def forward(self, inputs: Sequence):
        return self.fwd(inputs)

    def backward(self, inputs: Sequence, saved: Sequence):
        return self.bwd(inputs, saved)[0]
