"""Launch a compiled Triton kernel again without the JIT's per-call dispatch.

``kernel[grid](*args)`` binds the arguments, computes their specialization (dtypes, 16-byte
alignment of pointers, divisibility of integers), looks the compiled kernel up and asks the
driver, for every tensor, which device pointer it holds: 30-40 us of host time per launch,
more than the GPU time of a small decode. A :class:`PreparedLaunch` records one such launch and
repeats it with other tensors of the same shapes: the integer and constexpr arguments are kept,
tensors are passed as raw device pointers, and the compiled kernel's launcher is called
directly (a few microseconds). A tensor descriptor argument (``TensorDescriptor``) over one of
the tensor arguments follows that argument: a repeat passes the hardware descriptor (the
``CUtensorMap``) encoded for that argument's pointer, once per pointer and kept, where
Triton's launcher would encode every descriptor at every launch (2-3 us each).

Safe reuse is the caller's contract: a prepared launch may run again only for arguments whose
non-tensor values (shapes, strides, scale, flags) equal those it was prepared with, and tensors
of the same dtypes on the same CUDA device; :mod:`.dispatch` and :func:`launch` key their
caches on exactly that, and on each pointer's 16-byte alignment, the one specialisation that
depends on the tensors themselves (so calls aligned differently keep entries of their own;
:meth:`PreparedLaunch.__call__` checks it again and launches nothing when it differs). Launch
hooks (``triton.knobs.runtime.launch_enter_hook``, profilers) are not called for prepared
launches.

The direct launch reads Triton internals that change between releases, so it runs only on the
releases :mod:`.triton_support` lists as tested, and not at all with
``MINI_PAGED_ATTN_PUBLIC_LAUNCH=1``: there a :class:`PreparedLaunch` launches through the JIT
once and is never :attr:`~PreparedLaunch.ready`, so every call of the ops takes the public
``kernel[grid](...)`` path (same results, more host time).
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Hashable, Sequence

import torch

from .triton_support import direct_launch_enabled

logger = logging.getLogger(__name__)

ALIGNMENT = 16
"""Triton specialises pointer arguments on ``data_ptr() % 16 == 0``."""


def _leading_tensors(args: Sequence) -> int:
    """How many of ``args`` are tensors before the first non-tensor."""
    count = 0
    while count < len(args) and isinstance(args[count], torch.Tensor):
        count += 1
    return count


class _Address:
    """A device pointer standing in for a descriptor's base tensor (Triton's encoding reads
    only its ``data_ptr()``)."""

    __slots__ = ("address",)

    def __init__(self, address: int) -> None:
        self.address = address

    def data_ptr(self) -> int:
        return self.address


class _Rebased:
    """A prepared tensor descriptor's shape, strides and box (the repeat contract keeps them)
    over another base pointer: what Triton's encoding reads of a descriptor."""

    __slots__ = ("base", "shape", "strides", "block_shape", "padding")

    def __init__(self, descriptor, address: int) -> None:
        self.base = _Address(address)
        self.shape, self.strides = descriptor.shape, descriptor.strides
        self.block_shape, self.padding = descriptor.block_shape, descriptor.padding


class _EncodedDescriptor:
    """One tensor descriptor argument of a prepared launch: the launcher arguments it expands
    to (the encoded ``CUtensorMap`` then its shape and strides, or a base pointer and both
    twice where the kernel does not use TMA), kept per base pointer.

    The expansion is a function of the pointer alone (the repeat contract fixes the rest), so
    a kept one is exactly what encoding anew would give. Thread-safe for the use here: a lost
    entry costs one encoding."""

    MAX_POINTERS = 1024
    """Pointers kept before the map is emptied (an engine passes one K and one V cache a
    layer)."""

    def __init__(self, descriptor, metadata, encode) -> None:
        # Its layout over a bare pointer, not the descriptor: the descriptor holds its base
        # tensor, and an entry of the launch caches would keep that (a whole KV pool) alive
        # after its engine is gone.
        self._descriptor = _Rebased(descriptor, descriptor.base.data_ptr())
        self._metadata = metadata
        self._encode = encode
        self._expanded: dict[int, tuple] = {}
        self.width = len(self.expand(descriptor.base.data_ptr()))

    def expand(self, address: int) -> tuple:
        expanded = self._expanded.get(address)
        if expanded is None:
            if len(self._expanded) >= self.MAX_POINTERS:
                self._expanded.clear()
            expanded = tuple(self._encode(_Rebased(self._descriptor, address), self._metadata))
            self._expanded[address] = expanded
        return expanded


def _unwrapped_launch(launch):
    """Triton's compiled launch function under its tensor-descriptor wrapper: the wrapper
    (``wrap_handle_tensordesc`` in triton 3.6's CUDA driver) expands each descriptor argument,
    encoding it anew, and hands everything to the function it closes over as ``launcher``.
    None where ``launch`` is not such a wrapper."""
    names = getattr(getattr(launch, "__code__", None), "co_freevars", ())
    if "launcher" not in names:
        return None
    return launch.__closure__[names.index("launcher")].cell_contents


@functools.lru_cache(maxsize=None)
def _descriptor_types() -> tuple[type, ...]:
    """Triton's host tensor descriptor classes: ``triton.tools``' and Gluon's (which adds a
    shared-memory layout; the launcher reads the same fields of both)."""
    from triton.tools.tensor_descriptor import TensorDescriptor  # triton is optional
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    except ImportError:
        return (TensorDescriptor,)
    return (TensorDescriptor, GluonDescriptor)


class PreparedLaunch:
    """One launch of a ``@triton.jit`` kernel, made through the JIT, repeatable directly.

    Constructing it launches ``jit_fn[grid](*args, **kwargs)`` once (compiling if needed).
    :attr:`ready` is False where there is no compiled kernel to reuse (the Triton interpreter
    on CPU), where the kernel's tensor arguments do not all come first, or where
    :func:`~.triton_support.direct_launch_enabled` says no (an untested Triton, the public
    launch forced); calling it then always returns False.

    Args:
        jit_fn: the ``@triton.jit`` kernel.
        grid: the launch grid, a tuple of 1 to 3 ints.
        args, kwargs: the kernel's arguments as for ``jit_fn[grid]``: the tensors first and
            positional, launch options such as ``num_warps`` among ``kwargs``.
        descriptor_sources: for each ``TensorDescriptor`` among the other arguments, in order,
            the index of the tensor argument it is over: a repeat passes it encoded over that
            argument's pointer. A launch with a descriptor not named here, or with descriptors
            and scratch memory, is not repeatable.
    """

    def __init__(self, jit_fn, grid: tuple[int, ...], args: Sequence, kwargs: dict,
                 descriptor_sources: Sequence[int] = ()) -> None:
        compiled = jit_fn[grid](*args, **kwargs)
        self.kernel = compiled   # the compiled kernel (its registers, shared memory)
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        num_tensors = _leading_tensors(args)
        # The gate last: it is only asked where there is a compiled kernel (not under the
        # interpreter), and it logs its decision once.
        self.ready = (compiled is not None and num_tensors > 0
                      and not any(isinstance(a, torch.Tensor) for a in args[num_tensors:])
                      and direct_launch_enabled() and hasattr(compiled, "packed_metadata"))
        if not self.ready:
            return
        compiled._init_handles()
        launcher = compiled.run
        scratch = (getattr(launcher, "global_scratch_size", 0)
                   or getattr(launcher, "profile_scratch_size", 0)
                   or not hasattr(launcher, "launch"))
        if scratch:
            # The kernel needs scratch memory per launch: the launcher's wrapper allocates it.
            self._launch = launcher
            self._head = (compiled.function, compiled.packed_metadata, None, None, None)
        else:
            # With descriptors, the function under Triton's expansion: the repeat expands them.
            self._launch = (_unwrapped_launch(launcher.launch) if descriptor_sources
                            else launcher.launch)
            self._head = (compiled.function, launcher.launch_cooperative_grid,
                          launcher.launch_pdl, None, None, compiled.packed_metadata, None,
                          None, None)
        if descriptor_sources and (scratch or self._launch is None):
            logger.debug("%s: its tensor descriptors cannot be passed past Triton's launcher "
                         "here; every call goes through the JIT", jit_fn)
            self.ready = False
            return
        self._bind_arguments(jit_fn, args, kwargs, num_tensors, descriptor_sources,
                             getattr(compiled.metadata, "tensordesc_meta", None))
        from triton.runtime import driver
        # One C call per repeat (a bound partial), not a method and a lookup.
        self.stream = functools.partial(driver.active.get_current_stream, self._device_index)

    def _bind_arguments(self, jit_fn, args: Sequence, kwargs: dict, num_tensors: int,
                        descriptor_sources: Sequence[int], descriptor_metadata) -> None:
        """What a repeat needs from the prepared arguments: the tensors' alignment and device,
        and the kernel's remaining arguments in signature order, constexprs included (the
        launcher's argument format lists them too, and skips them), each tensor descriptor
        expanded as the launcher takes it."""
        self._aligned = [a.data_ptr() % ALIGNMENT == 0 for a in args[:num_tensors]]
        self.all_aligned = all(self._aligned)
        self._device_index = args[0].get_device()
        tail = list(args[num_tensors:]) + [kwargs[name] for name in jit_fn.arg_names[len(args):]]
        descriptor_types = _descriptor_types()
        positions = [i for i, arg in enumerate(tail) if isinstance(arg, descriptor_types)]
        if len(positions) != len(descriptor_sources):
            self.ready = False     # a descriptor whose tensor argument nobody named
            return
        from triton.backends.nvidia.driver import make_tensordesc_arg
        metadata = descriptor_metadata or [None] * len(positions)
        # Descriptor j follows tensor argument descriptor_sources[j]: (where its expansion
        # starts in the flat tail, tensor index, its encodings). By position, not by identity:
        # one tensor may be passed in several places (k is v, a scale pointer standing in).
        self._descriptors: list[tuple[int, int, _EncodedDescriptor]] = []
        flat: list = []
        for i, arg in enumerate(tail):
            if i not in positions:
                flat.append(arg)
                continue
            j = positions.index(i)
            assert arg.base is args[descriptor_sources[j]], "a descriptor over another tensor"
            encoded = _EncodedDescriptor(arg, metadata[j], make_tensordesc_arg)
            self._descriptors.append((len(flat), descriptor_sources[j], encoded))
            flat.extend(encoded.expand(arg.base.data_ptr()))
        self._tail = tuple(flat)
        # A repeat's whole tail kept by its descriptors' pointers: one lookup per launch.
        self._descriptor_pointers = operator.itemgetter(
            *(index for _, index, _ in self._descriptors)) if self._descriptors else None
        self._tails: dict = {}

    def __call__(self, tensors: Sequence[torch.Tensor | int]) -> bool:
        """Launch with ``tensors`` in place of the prepared launch's tensor arguments, in their
        order (an int is taken as a device pointer, e.g. an offset into a workspace).

        Returns:
            True if launched; False (nothing launched) if not ready or if a pointer's 16-byte
            alignment differs from the prepared launch's (the JIT must specialise anew).
        """
        if not self.ready:
            return False
        return self.launch_checked(tuple(t if type(t) is int else t.data_ptr()
                                         for t in tensors), self.stream())

    def launch_checked(self, ptrs: tuple[int, ...], stream: int) -> bool:
        """:meth:`__call__` with raw device pointers, launching on ``stream`` (the handle of
        the current stream of the launch's device: ``self.stream()``, set on a ready launch);
        only for a ready launch.
        The common case, every pointer aligned as prepared, costs one OR over the pointers."""
        if self.all_aligned:
            if functools.reduce(operator.or_, ptrs) % ALIGNMENT:
                return False
        elif [p % ALIGNMENT == 0 for p in ptrs] != self._aligned:
            return False
        self._launch(*self.grid, stream, *self._head, *ptrs, *self._tail_for(ptrs))
        return True

    def _tail_for(self, ptrs: Sequence[int]) -> tuple:
        """The non-tensor arguments of a repeat over ``ptrs``: the prepared ones, with each
        tensor descriptor's expansion for its tensor's pointer (kept per combination of
        those pointers; a new combination encodes only the pointers not seen before)."""
        if not self._descriptors:
            return self._tail
        key = self._descriptor_pointers(ptrs)
        tail = self._tails.get(key)
        if tail is None:
            if len(self._tails) >= _EncodedDescriptor.MAX_POINTERS:
                self._tails.clear()
            tail = list(self._tail)
            for start, index, encoded in self._descriptors:
                tail[start:start + encoded.width] = encoded.expand(ptrs[index])
            tail = self._tails[key] = tuple(tail)
        return tail


class LaunchCache:
    """A bounded map from an op call's key to what it prepared (emptied when full).

    Entries hold kernels, sizes and the runs' own scratch (:class:`StreamScratch`), never
    tensors of a call. Thread-safe for the use here: a lost or doubled entry costs one slow
    call.

    Args:
        max_entries: entries kept before the map is emptied.
    """

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._entries: dict[Hashable, object] = {}
        # The dict's own lookup (no Python frame on the repeat path); the dict is never
        # replaced, only emptied. Raises TypeError for an unhashable key.
        self.get = self._entries.get

    def put(self, key: Hashable, value: object) -> None:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[key] = value

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


class StreamScratch:
    """Zero-initialised float32 device memory that a repeatable run keeps, one buffer per CUDA
    stream, so its repeats allocate nothing (a ``torch.empty`` on CUDA costs 2-8 us of host
    time). A buffer is only ever used by launches on its own stream, which run one after
    another: a launch may rely on what the previous one left there (zeroed counters) and never
    races another stream. Freed with the run; the caching allocator hands freed memory only to
    later work on the same stream, so launches still in flight keep it.

    Not for CUDA-graph capture: a graph would keep the buffer's address after the run (and
    the buffer) is gone.

    Args:
        numel: float32 elements of each buffer.
        device: the CUDA device (or CPU, where the interpreter runs the kernels).
    """

    def __init__(self, numel: int, device: torch.device) -> None:
        self.numel = numel
        self.device = device
        self._buffers: dict[int, torch.Tensor] = {}
        self._pointers: dict[int, int] = {}

    def tensor(self) -> torch.Tensor:
        """The buffer of the device's current stream (made, zeroed, on first use); a CPU
        device (the interpreter) has one buffer, under stream 0."""
        stream = (torch.cuda.current_stream(self.device).cuda_stream
                  if self.device.type == "cuda" else 0)
        buffer = self._buffers.get(stream)
        if buffer is None:
            buffer = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
            self._buffers[stream] = buffer
            self._pointers[stream] = buffer.data_ptr()
        return buffer

    def pointer(self, stream: int) -> int:
        """Device address of the buffer of ``stream``, the handle of the current stream."""
        ptr = self._pointers.get(stream)
        return ptr if ptr is not None else self.tensor().data_ptr()


_LAUNCHES = LaunchCache(max_entries=1024)


def launch(jit_fn, grid: tuple[int, ...], args: Sequence, kwargs: dict) -> None:
    """``jit_fn[grid](*args, **kwargs)``, repeated through a :class:`PreparedLaunch` when an
    earlier launch at this call had the same grid, tensor dtypes and devices and non-tensor
    arguments (tensors first in ``args``; a kernel's launch sites pass the same kinds of
    values each time). The key is built from the arguments alone, so ops with few checks
    (the fused layers) need no key of their own. A kernel declaring a ``PDL`` constexpr gets
    it and ``launch_pdl`` from :func:`~.pdl.pdl_options` for the first tensor's device (part
    of the key), so its repeats pay nothing for them."""
    num_tensors = _leading_tensors(args)
    tensors = args[:num_tensors]
    # The interpreter (nothing to reuse) or a Triton the direct launch is not tested on.
    if not tensors or not tensors[0].is_cuda or not direct_launch_enabled():
        jit_fn[grid](*args, **_with_pdl(jit_fn, tensors, kwargs))
        return
    key = [jit_fn, grid, tuple(args[num_tensors:]), tuple(kwargs.items())]
    for t in tensors:
        key += (t.dtype, t.get_device(), t.data_ptr() % ALIGNMENT == 0)
    key = tuple(key)
    prepared = _LAUNCHES.get(key)
    if prepared is not None and prepared(tensors):
        return
    _LAUNCHES.put(key, PreparedLaunch(jit_fn, grid, args, _with_pdl(jit_fn, tensors, kwargs)))


def _with_pdl(jit_fn, tensors: Sequence[torch.Tensor], kwargs: dict) -> dict:
    """``kwargs`` plus ``PDL`` and ``launch_pdl`` (:func:`~.pdl.pdl_options` for the first
    tensor's device) when ``jit_fn`` declares a ``PDL`` argument; else ``kwargs`` itself."""
    if "PDL" not in getattr(jit_fn, "arg_names", ()):
        return kwargs
    # Here, not at the top: importing this module must not need Triton (an optional extra).
    from .pdl import pdl_options
    device = tensors[0].device if tensors else torch.device("cpu")
    return {**kwargs, **pdl_options(device)}


__all__ = ["ALIGNMENT", "LaunchCache", "PreparedLaunch", "StreamScratch", "launch"]
