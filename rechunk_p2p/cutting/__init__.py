"""Cutting input chunks into pieces, grouped by the worker each goes to.

Where it runs: task threads. :mod:`~rechunk_p2p.cutting.cutter` cuts one run's inputs,
:mod:`~rechunk_p2p.cutting.regular` cuts a regular chunk in one strided copy,
:mod:`~rechunk_p2p.cutting.joined` is the input of a transfer task that joins several
chunks, :mod:`~rechunk_p2p.cutting.scratch` keeps the buffers inputs are cut into, and
:mod:`~rechunk_p2p.cutting.in_place` sends a chunk's pieces as blocks of it, uncut.
"""
