"""Replicated data types (pure: no I/O, no asyncio, no torch). Filled by the CRDT issue."""
