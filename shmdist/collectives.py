"""Collectives computed in shared memory (work in progress)."""


def open_group(world, group):
    return None
