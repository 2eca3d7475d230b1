"""The fast paths: the few shortcuts that skip the general layers for the
common small call, all owned by one object with one switch.

- ``lane``: the engine's ``_core.Lane``: a small send or receive of a
  numpy array (or plain CPU tensor) on the default group in one C call.
- ``barrier`` and ``coll``: the default group's ``Phaser.barrier`` and
  its GroupComm, whose ``quick_all_reduce`` reduces a small array in one
  C call when the other members are already there.
- ``c_rounds``: the rounds of a large all_reduce run in C.
- ``learn``: the general path teaches the lane each dtype it accepted.

shmdist.send, recv and barrier are themselves C functions (_core,
_entry.pxi) that take ``lane`` and ``barrier`` without a Python frame; they
follow this object's two attributes (set here, they are set there).

Each shortcut either does the whole call or returns None/False having done
nothing, and the general path then runs; so turning them off (``enabled =
False``, as the tests' ``no_fast_paths`` fixture does) changes speed only.
``attach`` points them at a world when init_process_group finished and
``attach(None)`` at nothing when it is destroyed, forked or exits.
"""
from __future__ import annotations

import sys

import numpy as np

from shmdist import _core
from shmdist.transport.engine import dtype_field
from shmdist.tensors import is_torch_tensor, numpy_view


class FastPaths:
    def __init__(self):
        self.enabled = True      # the one switch
        self.c_rounds = True     # large all_reduce rounds in C (while enabled)
        self.lane = None         # the world's engine.lane while the world may be used
        self.barrier = None      # the default group's Phaser.barrier (shared-arena groups only)
        self.coll = None         # the default group's collective engine, for quick_all_reduce
        self.world = None        # the world, whose timeout (read at each call) the quick calls take
        self._tensor = None      # torch.Tensor, once the first torch tensor came

    def __setattr__(self, name, value) -> None:
        object.__setattr__(self, name, value)
        if name in ("lane", "barrier"):   # the C entry points (_core, _entry.pxi) follow
            _core.entry_attach(self.__dict__.get("lane"), self.__dict__.get("barrier"))

    def attach(self, world) -> None:
        """Point the shortcuts at ``world`` (None: at nothing)."""
        if world is None or not self.enabled:
            self.lane = self.barrier = self.coll = self.world = None
            return
        from shmdist.comm import arena
        coll = world.default.coll
        self.lane = world.engine.lane
        self.coll = coll
        self.world = world
        self.barrier = coll.ph.barrier if isinstance(coll, arena.GroupComm) else None

    def set_enabled(self, on: bool, world=None) -> None:
        """The switch: off, every call takes the general path."""
        self.enabled = on
        self.attach(world)

    def rounds_in_c(self) -> bool:
        return self.enabled and self.c_rounds

    def array(self, tensor, bits: bool = False) -> np.ndarray | None:
        """``tensor`` itself when it is a numpy array, a numpy view of a plain
        torch CPU tensor (no autograd, no conjugate or negative bit, a dtype
        numpy has), else None: what the fast paths may take. ``bits``: a
        bfloat16 tensor too, as a uint16 view of dtype tensors.BF16_BITS
        (``view.dtype is BF16_BITS`` tells it); only for the quick all_reduce,
        which is told the dtype's name: the lane's dtype table is keyed by
        numpy dtype, where bfloat16 and uint16 look alike."""
        if tensor.__class__ is np.ndarray:
            return tensor
        if tensor.__class__ is not self._tensor:
            if self._tensor is not None or not is_torch_tensor(tensor):
                return None
            self._tensor = sys.modules["torch"].Tensor
            if tensor.__class__ is not self._tensor:       # a subclass (Parameter...): the general way
                return None
        if tensor.requires_grad:
            return None
        try:
            return numpy_view(tensor, bits)             # tensor.numpy()'s view, cached (shmdist.tensors)
        except (RuntimeError, TypeError, ValueError):   # data_ptr() of a layout that has none
            return None

    def learn(self, engine, tensor, buf) -> None:
        """Teach the lane a dtype the general path accepted, by its numpy dtype."""
        if not self.enabled:
            return
        if tensor.__class__ is not np.ndarray:
            tensor = self.array(tensor)
            if tensor is None:
                return
        if tensor.dtype.name != buf.dtype or not tensor.dtype.isnative:   # the lane moves raw bytes
            return
        engine.lane.dtypes[tensor.dtype] = dtype_field(buf.dtype)


paths = FastPaths()
