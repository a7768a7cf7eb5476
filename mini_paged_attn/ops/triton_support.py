"""Which Triton versions the version-bound fast paths run on.

Two parts of :mod:`mini_paged_attn.ops` depend on Triton internals that change between
releases:

- the direct launch of :class:`~.launch.PreparedLaunch` calls a compiled kernel's launcher
  itself (its closures, ``_init_handles``, ``packed_metadata``, the driver's argument order,
  the CUDA driver's ``make_tensordesc_arg``);
- the Hopper prefill kernel (:mod:`.prefill_hopper`) is written in Gluon, an experimental
  API.

Both run only on the Triton releases listed in :data:`TESTED_TRITON_VERSIONS` (matched on
major.minor). On any other release, or with the environment variable
:data:`PUBLIC_LAUNCH_ENV` set to ``1`` (``true``, ``yes``, ``on``), every kernel launches
through the public ``kernel[grid](...)`` call and prefill runs the Triton kernel of
:mod:`.prefill_kernel`: the same results, a few tens of microseconds more host time per
launch, and the Triton kernel's prefill speed on an H100 / H200. The first decision a
process makes logs one line saying which path it takes and why; the answer is read once
(the version and the variable) and kept for the life of the process.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os

logger = logging.getLogger(__name__)

TESTED_TRITON_VERSIONS: tuple[str, ...] = ("3.6",)
"""Triton releases (major.minor) the direct launch and the Gluon prefill were tested on."""

PUBLIC_LAUNCH_ENV = "MINI_PAGED_ATTN_PUBLIC_LAUNCH"
"""Set to ``1`` to force the public launch path (and the Triton prefill, no Gluon)."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class TritonSupport:
    """What this process runs: the Triton version, whether it is a tested one, and whether
    :data:`PUBLIC_LAUNCH_ENV` forces the public path.

    Attributes:
        version: Triton's ``__version__`` (e.g. ``"3.6.0"``), or None without Triton.
        tested: its major.minor is in :data:`TESTED_TRITON_VERSIONS`.
        forced_public: the environment variable asks for the public path.
        gluon_present: ``triton.experimental.gluon`` can be imported.
    """

    version: str | None
    tested: bool
    forced_public: bool
    gluon_present: bool

    @property
    def direct_launch(self) -> bool:
        """Whether :class:`~.launch.PreparedLaunch` may call compiled launchers directly."""
        return self.tested and not self.forced_public

    @property
    def gluon_prefill(self) -> bool:
        """Whether the Gluon prefill kernel (:mod:`.prefill_hopper`) may be chosen."""
        return self.direct_launch and self.gluon_present

    def describe(self) -> str:
        """One line: the version, the path taken and why."""
        if self.version is None:
            return "Triton is not installed: the Triton kernels do not run"
        if self.forced_public:
            return (f"Triton {self.version}: {PUBLIC_LAUNCH_ENV} is set, so kernels launch "
                    "through kernel[grid](...) and prefill runs the Triton kernel (no Gluon)")
        if not self.tested:
            return (f"Triton {self.version} is not among the tested versions "
                    f"({', '.join(TESTED_TRITON_VERSIONS)}): kernels launch through "
                    "kernel[grid](...) (more host time per launch) and prefill runs the Triton "
                    "kernel (no Gluon)")
        return (f"Triton {self.version}: direct launches"
                + (" and the Gluon prefill" if self.gluon_present else ""))


def major_minor(version: str) -> str:
    """``"3.6.0"`` / ``"3.9.0+git1a2b"`` / ``"3.6"`` -> ``"3.6"``.

    Raises:
        ValueError: ``version`` does not start with two dot-separated integers.
    """
    parts = str(version).split(".")
    if len(parts) < 2 or not parts[0].isdigit() or not parts[1][:1].isdigit():
        raise ValueError(f"version: expected a version like '3.6.0', got {version!r}")
    minor = ""
    for ch in parts[1]:
        if not ch.isdigit():
            break
        minor += ch
    return f"{int(parts[0])}.{int(minor)}"


def parse_public_launch(value: str | None) -> bool:
    """The value of :data:`PUBLIC_LAUNCH_ENV` (None: unset) as a switch.

    Raises:
        ValueError: a value that is neither true (``1``, ``true``, ``yes``, ``on``) nor false
            (unset, empty, ``0``, ``false``, ``no``, ``off``), case-insensitive.
    """
    if value is None:
        return False
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{PUBLIC_LAUNCH_ENV}: expected 1 or 0 (true/false, yes/no, on/off), "
                     f"got {value!r}")


def support_for(version: str | None, public_launch: str | None,
                gluon_present: bool) -> TritonSupport:
    """The decision for a Triton ``version`` (None: not installed) and a value of
    :data:`PUBLIC_LAUNCH_ENV` (None: unset); pure, for callers and tests that ask about
    another version than the installed one."""
    forced = parse_public_launch(public_launch)
    tested = version is not None and major_minor(version) in TESTED_TRITON_VERSIONS
    return TritonSupport(version=version, tested=tested, forced_public=forced,
                         gluon_present=gluon_present)


def _installed_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _gluon_importable() -> bool:
    try:
        return importlib.util.find_spec("triton.experimental.gluon") is not None
    except ImportError:     # no triton, or no triton.experimental
        return False


@functools.lru_cache(maxsize=1)
def triton_support() -> TritonSupport:
    """This process's decision (read once, then kept; logged once: a warning where the
    installed Triton is untested, else info).

    Raises:
        ValueError: :data:`PUBLIC_LAUNCH_ENV` holds a value that is not a switch.
    """
    support = support_for(_installed_version(), os.environ.get(PUBLIC_LAUNCH_ENV),
                          _gluon_importable())
    if support.version is not None and not support.tested and not support.forced_public:
        logger.warning("%s", support.describe())
    else:
        logger.info("%s", support.describe())
    return support


def direct_launch_enabled() -> bool:
    """Whether :class:`~.launch.PreparedLaunch` repeats launches by calling the compiled
    kernel's launcher (a tested Triton, :data:`PUBLIC_LAUNCH_ENV` unset)."""
    return triton_support().direct_launch


def gluon_prefill_enabled() -> bool:
    """Whether the Gluon prefill kernel may run (as :func:`direct_launch_enabled`, and Gluon
    importable); the device and shape rules are :mod:`.prefill_plan`'s."""
    return triton_support().gluon_prefill


__all__ = ["PUBLIC_LAUNCH_ENV", "TESTED_TRITON_VERSIONS", "TritonSupport",
           "direct_launch_enabled", "gluon_prefill_enabled", "major_minor",
           "parse_public_launch", "support_for", "triton_support"]
