"""Collective engines behind the arena.Comm contract: a group's shared
arena (arena), groups spanning hosts (hier) and the leaders' leg between hosts (inter)."""
